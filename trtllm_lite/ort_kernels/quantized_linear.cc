// trtllm_lite::QuantizedLinear and QuantizedLinearWithOffsets: a 4-bit block-quantized linear
// layer at float32 activations, one node where the ONNX Runtime graphs had MatMulNBits (+
// AddBlockOffsets); builder/fused_ops.py has their ONNX function bodies.
//
//   inputs   x [M, K] float32,
//            qweight [N, nb, block_size / 2] uint8 (MatMulNBits' codes, nb = ceil(K / block_size):
//            byte i of a block holds weights 2i (low nibble) and 2i + 1), scales [N, nb] float32,
//            zero_points [N, ceil(nb / 2)] uint8 (4-bit, low nibble first),
//            WithOffsets: offsets [N, nbo] float32 (float offsets of x's first nbo blocks: GGUF
//            Q4_1's mins; builder/quantize.py), block_sum_matrix (read only by the function body)
//   attrs    N, K, block_size
//   output   y [M, N] float32,  y[m, n] = sum_k x[m, k] w[n, k],
//            w[n, k] = (q[n, k] - z[n, b]) * scale[n, b] + offset[n, b]   (b = k / block_size)
//
// MatMulNBits at float32 activations (accuracy level 0) dequantizes each weight panel to a
// float32 buffer and runs its SGEMM on it: at batch 1 that streams ~20 GB/s of a ~50 GB/s
// bus, and Q4_1's mins need a second node. Here each node repacks its constant weights once
// (the first call) so that one 64-byte vector holds 16 output rows x 8 input columns:
//
//   per 16-row group, per block: ceil(block_size / 8) chunks of [16 rows][4 bytes], byte i of
//   row r's 4 bytes in chunk j holding the codes of columns 8j + i (low nibble) and 8j + 4 + i
//   (high nibble; code 0 past the block's end; the AVX2 build stores q XOR 8, read as the signed
//   q - 8: kSignedCodes4); then the block's scale and offset for the 16
//   rows (float16 when every value is exact there, as GGUF's are; float32 otherwise),
//   offset = offsets - scale * zero_point (zero points folded). The buffers come from shared
//   slabs on 2 MiB pages (HugePageSlabs: streamed whole every step, 4 KiB pages cost a TLB
//   miss each).
//
//   QuantizedLinearSplit8: the tensors of QuantizedLinearWithOffsets for an 8-bit weight split
//   into two 4-bit halves (builder/quantize.py split_8bit: K = 2 K8), and x [M, K8] once (its
//   function body feeds [x, x] to QuantizedLinearWithOffsets). The weight is recombined once
//   into chunks of [16 rows][4 bytes], byte i holding column 4j + i's code as a signed byte
//   (u - 128), with one scale and offset per 16 rows and block (Kernel::pack_split): 36 bytes
//   per 32 weights where the halves took 40, and five vpdpbusd per 64 weights at batch 1 where
//   the halves took 13 per 128 codes.
//
//   Where every folded offset of a node is 0 (an 8-bit weight with zero point 128: GGUF Q8_0,
//   symmetric int8), its blocks store no offsets (Packed::offsets; the loops read 0): 34 bytes
//   per 32 weights (SmolLM2 int4's Q8_0 lm_head: 31.9 -> 30.1 MB a decode step).
//
//   M = 1 (memory-bound), AVX-512 VNNI: x is centered per block (c = x - mean_b) and written
//     as 32-bit integers C = round(c * 2^s_b) (s_b: the power of two that puts the block's
//     largest |c| in [2^30, 2^31)), each as four unsigned bytes of C + 2^31. One vpdpbusd
//     multiplies four of those bytes by four codes and adds them into each row's int32 sum,
//     so a 64-byte chunk (128 weights) costs five logic ops and eight vpdpbusd (four byte
//     planes x two nibbles; the codes' sum Q added up as bytes, two of the five ops). The integer sums are exact; the block's
//     sum_k c_k q_k is then (A0 + 2^8 A1 + 2^16 A2 + 2^24 (A3 - 128 Q)) / 2^s_b, rounded once
//     to float32, and y += scale * that + mean_b * (scale * Q + block_size * offset) + offset *
//     sum_k c_k (Q = the codes' sum; the second factor is the block's weight sum; the last term
//     is not 0 where the rounded mean is inexact: x = 1e3 + N(0, 1) lost ~1e-5 relative without
//     it on Zen 5, x near float32's subnormals ~1e-4). Against float32 arithmetic:
//     each c at 2^-7 of its block's largest or more is exact, smaller ones are rounded to
//     2^-32 of the largest (float32 would round them to 2^-24 of their own), and the sums are
//     not rounded at all. (With three planes, 24 bits, a block of one large and many small
//     values was ~10x float32's error, found by QA; the fourth plane costs ~7% of SmolLM2 int4's
//     batch-1 speed.) On a CPU with two 512-bit ports the float loop below is bound by its
//     permutes at ~15 GB/s a core; this one is not.
//   M <= 4, AVX2 (no AVX-512): x as 30-bit integers in two int16 planes (not centered), and
//     vpmaddwd of pairs of codes by pairs of x (gemv_group_pairs_avx2): exact integer sums.
//   M = 1 without VNNI: the same centering, in float32: per block t = sum_k c_k q[:, k]
//     (c broadcast; a code becomes a float by one permute: vpermps reads the low 4 bits of
//     each index lane, so the 16-entry table {0, 1, ..., 15} turns codes into floats without
//     masking or converting; the other columns: a shift first).
//   M = 2-8, AVX-512 VNNI: the M = 1 loop over up to 4 rows' planes in one pass over the
//     weights (two passes for 5-8; Kernel::compute): each row's sums are its batch-1 sums.
//   M > 1 otherwise (compute-bound as M grows): w = q * scale + offset (the dequantized float32 weight,
//     one rounding) for two groups, once per work item of up to 64 rows into a panel in L2,
//     then register tiles of up to 8 rows of x x 32 outputs over it.
#include <sys/mman.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>

#include "kernel_common.h"

// The batch-1 integer path needs AVX-512 VNNI (vpdpbusd) and BW (byte adds and shifts).
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TRTLLM_LITE_VNNI 1
#endif

namespace trtllm_lite_kernels {
namespace {

constexpr ONNXTensorElementDataType kU8 = static_cast<ONNXTensorElementDataType>(2);   // uint8
constexpr ONNXTensorElementDataType kInputs[6] = {kF32, kU8, kF32, kU8, kF32, kF32};   // (4 without offsets)
constexpr int64_t kLanes = 16;      // output rows per group (one float32 vector)
constexpr int64_t kTileRows = 8;    // rows of x per register tile (M > 1)
constexpr int64_t kRowsPerItem = 64;
constexpr int64_t kChunkBytes = 64;  // one vector: 16 rows x 8 columns of 4-bit codes
constexpr int64_t kPrefetchBytes = 8192;   // the batch-1 loops (VNNI, AVX2): L2 prefetch distance
constexpr int kPlanes = 4;   // bytes of x's 32-bit integers (gemv_groups_vnni)
constexpr int64_t kStreams = 4;   // the batch-1 VNNI loop's weight streams per work item
constexpr int64_t kVnniPassRows = 4;   // rows of x one pass of the VNNI batch-1 loop takes (gemv_groups_vnni)
constexpr int64_t kVnniGemvRows = 8;   // up to this many rows take the VNNI loop, in passes (Kernel::compute)

// Every node's repacked weights come from shared slabs, 2 MiB-aligned, that ask the kernel for
// transparent 2 MiB pages (madvise; advice only): the weights are streamed whole every step, and
// with 4 KiB pages each page costs a TLB miss (SmolLM2 int4 batch 1 ran at ~66 or ~100 tokens/s
// from one process to the next that way on a Xeon VM). Most nodes' weights are under 2 MiB
// (SmolLM2's layer linears: 0.2-1.1 MB), so a buffer of their own could only use huge pages by
// rounding each up to 2 MiB of memory. A slab is freed when its last buffer is.
class HugePageSlabs {
 public:
  static HugePageSlabs& instance() {
    static HugePageSlabs* slabs = new HugePageSlabs;   // never destroyed: kernels may outlive statics
    return *slabs;
  }

  // `size` bytes, 64-byte aligned, zeroed; nullptr when out of memory.
  uint8_t* allocate(size_t size) {
    size = (size + 63) / 64 * 64;
    std::lock_guard<std::mutex> lock(mutex_);
    if (slabs_.empty() || slabs_.back().used + size > slabs_.back().size) {
      const size_t slab_size = std::max(kSlabBytes, (size + kHugePage - 1) / kHugePage * kHugePage);
      auto* base = static_cast<uint8_t*>(std::aligned_alloc(kHugePage, slab_size));
      if (!base) return nullptr;
#ifdef MADV_HUGEPAGE
      madvise(base, slab_size, MADV_HUGEPAGE);
#endif
      slabs_.push_back({base, slab_size, 0, 0});
    }
    Slab& slab = slabs_.back();
    uint8_t* p = slab.base + slab.used;
    slab.used += size;
    ++slab.live;
    std::memset(p, 0, size);
    return p;
  }

  void release(const uint8_t* p) {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < slabs_.size(); ++i) {
      Slab& slab = slabs_[i];
      if (p < slab.base || p >= slab.base + slab.size) continue;
      if (--slab.live == 0) {
        std::free(slab.base);
        slabs_.erase(slabs_.begin() + static_cast<std::ptrdiff_t>(i));
      }
      return;
    }
  }

 private:
  static constexpr size_t kHugePage = size_t{2} << 20, kSlabBytes = size_t{32} << 20;
  struct Slab {
    uint8_t* base;
    size_t size, used;
    int64_t live;   // buffers not yet released
  };
  std::mutex mutex_;
  std::vector<Slab> slabs_;   // the last one is being filled
};

// A node's share of the slabs.
class SlabBytes {
 public:
  SlabBytes() = default;
  SlabBytes(const SlabBytes&) = delete;
  SlabBytes& operator=(const SlabBytes&) = delete;
  ~SlabBytes() { HugePageSlabs::instance().release(data_); }
  bool assign(size_t size) {   // false when out of memory
    HugePageSlabs::instance().release(data_);
    data_ = HugePageSlabs::instance().allocate(size);
    return data_ != nullptr;
  }
  uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
};

// One node's weights, repacked (layout above).
struct Packed {
  int64_t n = 0, nb = 0, block_size = 0, groups = 0;
  int bits = 4;                      // 8: a split 8-bit weight, recombined (Kernel::pack_split)
  bool half = false;                 // scales and offsets stored as float16
  bool offsets = true;               // false: every offset is 0 (Q8_0, symmetric int8) and none is stored
  SlabBytes data;
  int64_t columns() const { return bits == 4 ? 8 : 4; }           // columns per chunk (x 16 rows)
  int64_t chunks() const { return (block_size + columns() - 1) / columns(); }
  int64_t width() const { return chunks() * columns(); }          // a block's columns, padded
  int64_t code_bytes() const { return chunks() * kChunkBytes; }
  int64_t scale_bytes() const { return kLanes * (half ? 2 : 4); }   // a block's 16 scales (or offsets)
  int64_t block_bytes() const { return code_bytes() + (offsets ? 2 : 1) * scale_bytes(); }
  const uint8_t* block(int64_t group, int64_t b) const { return data.data() + (group * nb + b) * block_bytes(); }
};

// The AVX2 build stores a 4-bit code q as q XOR 8, which its batch-1 loops read as the signed
// q - 8 (a 4-bit field sign-extended: two shifts, as many as the mask and shift of q) against the
// offset + 8 scale: w = (q - 8) scale + (offset + 8 scale). Centered codes keep the two terms
// of a block's sum, scale * sum_k x_k (q_k - 8) and (offset + 8 scale) * sum_k x_k, from
// cancelling where x has a common part (x_pairs_avx2 does not center x).
#ifdef TRTLLM_LITE_AVX2
constexpr int kCodeXor4 = 8;
#else
constexpr int kCodeXor4 = 0;
#endif

// Column k's code of row `lane` in a repacked block (layout above).
inline int code_at(const Packed& w, const uint8_t* block, int64_t lane, int64_t k) {
  if (w.bits == 8) return static_cast<int8_t>(block[k / 4 * kChunkBytes + lane * 4 + k % 4]);
  const uint8_t byte = block[k / 8 * kChunkBytes + lane * 4 + k % 4];
  return (k % 8 < 4 ? byte & 15 : byte >> 4) ^ kCodeXor4;
}

struct Step {
  const Packed* w;
  const float* x;      // [M, ldx >= nb * block_size]: x, zero-padded to whole blocks if needed
  const float* means;  // M = 1 (AVX-512 build; VNNI: [M][nb], M <= kVnniPassRows): [nb] block
                       // means of x, which x then holds centered per block (gemv_group)
  const float* centered_sums;   // as means: [nb] sum_k c_k of the centered x as the loops read
                                // it (not 0 where the mean is inexact)
  const uint8_t* planes;   // VNNI, M <= kVnniPassRows: [M][nb][4][chunks * 8] the byte planes of C + 2^31
  const float* factors;    // VNNI, M <= kVnniPassRows: [M][nb][2] 2^-s_b as two factors
  int64_t range_items;     // VNNI, M <= kVnniPassRows: work items, each a contiguous range of groups
  uint64_t call;           // VNNI / AVX2 batch 1 (gemv_rows): this pass's number (own_x_step)
  const int32_t* pairs;    // AVX2, M <= 4: [rows][nb * width] x's int16 pairs (x_pairs_avx2)
  const double* block_terms;   // AVX2, M <= 4: [rows][nb][2] 2^-s_b and sum_k C_k (x_pairs_avx2)
  float* y;            // [M, N]
  int64_t rows, ldx;
};

// Columns 8j + i of a chunk, i = 0..7: the shift that brings column i's code to the low 4 bits
// of each row's 32-bit lane (vpermps reads only those).
[[maybe_unused]] constexpr int kColumnShift[8] = {0, 8, 16, 24, 4, 12, 20, 28};

#if defined(TRTLLM_LITE_VNNI) || defined(TRTLLM_LITE_AVX2)
// 2^e for e in [-126, 127] (a normal float: its exponent bits), without a libm call.
inline float power_of_two(int e) {
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// std::frexp's exponent of a finite a >= 0 (a < 2^e), from its bits where a is normal.
inline int exponent_of(float a) {
  uint32_t bits;
  std::memcpy(&bits, &a, 4);
  const int biased = static_cast<int>(bits >> 23);
  if (biased == 0) {   // zero or subnormal
    int e = 0;
    std::frexp(a, &e);
    return e;
  }
  return biased - 126;
}
#endif

#ifdef __AVX512F__

inline __m512 column_codes(__m512i chunk, int i, __m512 table) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(chunk, kColumnShift[i]), table);
}
// Column 4j + i of an 8-bit chunk (byte i of each row's lane, signed).
inline __m512 column_codes8(__m512i chunk, int i) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(chunk, 24 - 8 * i), 24));
}
template <int BITS>
inline __m512 chunk_column(__m512i chunk, int i, __m512 table) {
  return BITS == 4 ? column_codes(chunk, i, table) : column_codes8(chunk, i);
}
inline __m512i load_chunk(const uint8_t* p) { return _mm512_loadu_si512(p); }

// A block's 16 scales and offsets, p: after its codes (offsets 0 where the layout stores none).
template <bool HALF>
inline void load_scale_offset(const Packed& w, const uint8_t* p, __m512* scale, __m512* offset) {
  if (HALF) {
    *scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    *offset = w.offsets ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))
                        : _mm512_setzero_ps();
  } else {
    *scale = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
    *offset = w.offsets ? _mm512_loadu_ps(reinterpret_cast<const float*>(p) + 16) : _mm512_setzero_ps();
  }
}

inline __mmask16 lanes_mask(const Packed& w, int64_t group) {
  const int64_t lanes = std::min<int64_t>(kLanes, w.n - group * kLanes);
  return static_cast<__mmask16>((1u << lanes) - 1);
}

// x (one row) centered per block: means[b] = mean of block b, centered = x - means[b] (the
// block's own mean; [nb * block_size] float32), sums[b] = sum_k centered_k in float64, rounded
// once: the rounded mean leaves it nonzero (x = 1e3 + N(0, 1): ~1e-4 a value), and the
// block's offset times it is part of y (gemv_group).
inline void center_blocks(const float* x, int64_t nb, int64_t block_size, float* means, float* centered,
                          float* sums) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * block_size;
    const float inv = 1.0f / static_cast<float>(block_size);
    float mean = 0.0f;   // a sum of x / block_size: a sum of x could overflow where the mean does not
#pragma omp simd reduction(+ : mean)
    for (int64_t i = 0; i < block_size; ++i) mean += xb[i] * inv;
    means[b] = mean;
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < block_size; ++i) {
      centered[b * block_size + i] = xb[i] - mean;
      sum += static_cast<double>(xb[i] - mean);
    }
    sums[b] = static_cast<float>(sum);
  }
}

#ifdef TRTLLM_LITE_VNNI
// x (one row) centered per block and written as 32-bit integers, per block b: means[b] = the
// block's mean, C = round((x - means[b]) * 2^s_b), s_b putting the block's largest
// |x - mean| in [2^30, 2^31), stored as the four bytes of C + 2^31 (planes [nb][4][width],
// columns past the block's end left as they are: their codes are 0); 2^-s_b as two factors
// (factors[2b], factors[2b + 1]; s_b ranges over ~[-97, 179], beyond one float's exponents).
// A value of x at 2^-7 of its block's largest or more converts exactly (float32 holds 24
// bits); smaller ones round to 2^-32 of the largest. A block with a NaN or infinity gets factor
// NaN, so its outputs are NaN as float32 arithmetic's would be. sums[b] = sum_k C_k 2^-s_b (the
// integers' exact sum, rounded once): not 0 where the mean is inexact (gemv_groups_vnni adds the
// block's offset times it).
inline void integer_planes(const float* x, int64_t nb, int64_t block_size, int64_t width, float* means,
                           uint8_t* planes, float* factors, float* sums) {
  auto lanes = [block_size](int64_t i) {
    return static_cast<__mmask16>(block_size - i >= 16 ? 0xFFFF : (1u << (block_size - i)) - 1);
  };
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * block_size;
    uint8_t* plane = planes + b * kPlanes * width;
    // the mean as a sum of x / block_size: a sum of x could overflow where the mean does not
    const __m512 inv = _mm512_set1_ps(1.0f / static_cast<float>(block_size));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < block_size; i += 16) sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes(i), xb + i), inv, sum);
    const float mean = _mm512_reduce_add_ps(sum);
    means[b] = mean;
    const __m512 mean16 = _mm512_set1_ps(mean);
    __m512 largest = _mm512_setzero_ps();
    for (int64_t i = 0; i < block_size; i += 16) {
      const __mmask16 m = lanes(i);
      const __m512 c = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, xb + i), mean16);
      largest = _mm512_max_ps(largest, _mm512_mask_abs_ps(_mm512_setzero_ps(), m, c));
    }
    const float amax = _mm512_reduce_max_ps(largest);
    if (!std::isfinite(mean) || !std::isfinite(amax)) {   // NaN/inf in x (or |x - mean| past float32's range)
      factors[2 * b] = factors[2 * b + 1] = sums[b] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const int shift = 31 - exponent_of(amax), half = shift / 2;   // |half|, |shift - half| <= 82
    factors[2 * b] = power_of_two(-half);
    factors[2 * b + 1] = power_of_two(half - shift);
    // c * 2^s in two exact steps (powers of two): below 2^31 in magnitude, so no clamp
    const __m512 up1 = _mm512_set1_ps(power_of_two(half)), up2 = _mm512_set1_ps(power_of_two(shift - half));
    const __m512i bias = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
    __m512i sum_c = _mm512_setzero_si512();   // int64 lanes: at most 2^31 x block_size
    for (int64_t i = 0; i < block_size; i += 16) {
      const __mmask16 m = lanes(i);
      const __m512 c = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, xb + i), mean16);
      const __m512i ci = _mm512_maskz_cvtps_epi32(m, _mm512_mul_ps(_mm512_mul_ps(c, up1), up2));
      sum_c = _mm512_add_epi64(sum_c, _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(ci)),
                                                      _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(ci, 1))));
      const __m512i v = _mm512_add_epi32(ci, bias);
      for (int k = 0; k < kPlanes; ++k)
        _mm512_mask_cvtepi32_storeu_epi8(plane + k * width + i, m, _mm512_srli_epi32(v, 8 * k));
    }
    sums[b] = static_cast<float>(static_cast<double>(_mm512_reduce_add_epi64(sum_c)) *
                                 static_cast<double>(factors[2 * b]) * static_cast<double>(factors[2 * b + 1]));
  }
}

inline __m512i broadcast4(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Block b's share of a group's y (acc, acc_means) from its exact integer sums per row:
// a_i = sum_k plane_i[k] q[:, k] (x's byte planes) and q = sum_k q[:, k]; p: the block.
template <bool HALF>
inline void add_block_sums(const Step& st, const Packed& w, const uint8_t* p, int64_t b, __m512i a0, __m512i a1,
                           __m512i a2, __m512i a3, __m512i q, __m512& acc, __m512& acc_means) {
  __m512 scale, offset;
  load_scale_offset<HALF>(w, p + w.code_bytes(), &scale, &offset);
  const __m512 codes_sum = _mm512_cvtepi32_ps(q);
  const __m512 top = _mm512_cvtepi32_ps(_mm512_sub_epi32(a3, _mm512_slli_epi32(q, 7)));   // C's bias removed
  const __m512 t = _mm512_fmadd_ps(
      top, _mm512_set1_ps(16777216.0f),
      _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), _mm512_set1_ps(65536.0f),
                      _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(a0))));
  acc = _mm512_fmadd_ps(_mm512_mul_ps(t, _mm512_set1_ps(st.factors[2 * b])),
                        _mm512_mul_ps(scale, _mm512_set1_ps(st.factors[2 * b + 1])), acc);
  const __m512 block_size = _mm512_set1_ps(static_cast<float>(w.block_size));
  const __m512 weight_sum = _mm512_fmadd_ps(scale, codes_sum, _mm512_mul_ps(block_size, offset));
  acc_means = _mm512_fmadd_ps(weight_sum, _mm512_set1_ps(st.means[b]), acc_means);
  acc_means = _mm512_fmadd_ps(offset, _mm512_set1_ps(st.centered_sums[b]), acc_means);
}

// M <= kVnniPassRows with VNNI: the 16-row groups [first, last) on the integer planes of x's
// ROWS rows (file comment), read as kStreams streams: the range in kStreams parts, block b of
// one group of each part, then block b + 1, ... A core keeps more lines in flight over several
// streams than over one (measured on a 2-core Xeon VM: a plain read of 512 MB at 19 GB/s as one
// stream per core, 23-30 as four; this loop over 168 MB: 18-19 -> 23-26 GB/s). Every line of a
// group's weights is prefetched into L2 kPrefetchBytes ahead: SmolLM2 int4 batch 1 on a 2-core
// Xeon VM went ~140 -> ~180 -> ~222 tokens/s at 0 / 2 / 8 KiB (flat to 32 KiB; the hardware
// prefetcher alone keeps too few lines in flight there; into L1: no better, non-temporal: half
// the speed). 4-bit chunks: five logic ops and eight vpdpbusd per row of x per 128 weights, and
// the codes' sums added up as bytes, one vpdpbusd per 8 chunks (a vpdpbusd per chunk: SmolLM2's
// 120 layer linears 1.03x slower on one core, 1.01-1.02x on two, 2-core Zen 4 VM: on one core
// the loop is bound by the two ports that run vpdpbusd and the float multiply-adds, ~14 a chunk
// with the block's share of add_block_sums; in a two-thread batch-1 step on the shared bus, half
// the vpdpbusd gave only 1.045x); 8-bit (signed bytes): one vpdpbusd for the sums and four
// per row per 64 weights. The rows share each chunk's load and unpacking, and each row's sums
// are the one-row loop's, bit for bit.
template <bool HALF, int BITS, int ROWS>
void gemv_groups_vnni(const Step& st, int64_t first, int64_t last) {
  const Packed& w = *st.w;
  const int64_t width = w.width(), per_stream = (last - first + kStreams - 1) / kStreams;
  const int64_t row_planes = w.nb * kPlanes * width;
  const __m512i low4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
  // each row's view of the step: its planes, factors, means and sums (add_block_sums)
  Step rows[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    rows[r] = st;
    rows[r].planes = st.planes + r * row_planes;
    rows[r].factors = st.factors + r * 2 * w.nb;
    rows[r].means = st.means + r * w.nb;
    rows[r].centered_sums = st.centered_sums + r * w.nb;
  }
  // the first kPrefetchBytes of each stream, which the loop's prefetches run ahead of
  for (int64_t part = 0; part < kStreams && first + part * per_stream < last; ++part) {
    const uint8_t* start = w.block(first + part * per_stream, 0);
    for (int64_t line = 0; line < kPrefetchBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(start + line), _MM_HINT_T1);
  }
  for (int64_t i = 0; i < per_stream; ++i) {
    int64_t groups[kStreams];
    int live = 0;
    for (int64_t part = 0; part < kStreams; ++part)
      if (first + part * per_stream + i < last) groups[live++] = first + part * per_stream + i;
    __m512 acc[kStreams][ROWS], acc_means[kStreams][ROWS];
    for (int s = 0; s < live; ++s)
      for (int r = 0; r < ROWS; ++r) acc[s][r] = acc_means[s][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w.nb; ++b) {
      const uint8_t* x0 = st.planes + b * kPlanes * width;   // row 0's planes of block b
      for (int s = 0; s < live; ++s) {
        const uint8_t* p = w.block(groups[s], b);
        __m512i a[ROWS][kPlanes], q = _mm512_setzero_si512(), code_sums = q;
        for (int r = 0; r < ROWS; ++r)
          for (int k = 0; k < kPlanes; ++k) a[r][k] = _mm512_setzero_si512();
        for (int64_t j = 0; j < w.chunks(); ++j) {
          _mm_prefetch(reinterpret_cast<const char*>(p + j * kChunkBytes + kPrefetchBytes), _MM_HINT_T1);
          const __m512i v = load_chunk(p + j * kChunkBytes);
          if (BITS == 8) {   // codes are signed bytes: x's unsigned planes times them as they are
            for (int r = 0; r < ROWS; ++r)
              for (int k = 0; k < kPlanes; ++k)
                a[r][k] = _mm512_dpbusd_epi32(a[r][k], broadcast4(x0 + r * row_planes + k * width + 4 * j), v);
            q = _mm512_dpbusd_epi32(q, ones, v);
            continue;
          }
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          for (int r = 0; r < ROWS; ++r) {
            const uint8_t* xr = x0 + r * row_planes + 8 * j;
            for (int k = 0; k < kPlanes; ++k) a[r][k] = _mm512_dpbusd_epi32(a[r][k], broadcast4(xr + k * width), lo);
            for (int k = 0; k < kPlanes; ++k) a[r][k] = _mm512_dpbusd_epi32(a[r][k], broadcast4(xr + k * width + 4), hi);
          }
          // the codes' sums as bytes (at most 8 chunks x 30 = 240), one vpdpbusd per 8 chunks
          code_sums = _mm512_add_epi8(code_sums, _mm512_add_epi8(lo, hi));
          if ((j & 7) == 7 || j + 1 == w.chunks()) {
            q = _mm512_dpbusd_epi32(q, code_sums, ones);
            code_sums = _mm512_setzero_si512();
          }
        }
        _mm_prefetch(reinterpret_cast<const char*>(p + w.code_bytes() + kPrefetchBytes), _MM_HINT_T1);
        for (int r = 0; r < ROWS; ++r)
          add_block_sums<HALF>(rows[r], w, p, b, a[r][0], a[r][1], a[r][2], a[r][3], q, acc[s][r], acc_means[s][r]);
      }
    }
    for (int s = 0; s < live; ++s)
      for (int r = 0; r < ROWS; ++r)
        _mm512_mask_storeu_ps(st.y + r * w.n + groups[s] * kLanes, lanes_mask(w, groups[s]),
                              _mm512_add_ps(acc[s][r], acc_means[s][r]));
  }
}

// gemv_groups_vnni for this node's layout (float16 or float32 scales, 4- or 8-bit codes) and
// st.rows (1 to kVnniPassRows).
template <int ROWS>
void gemv_groups_vnni_rows(const Step& st, int64_t first, int64_t last) {
  const Packed& w = *st.w;
  if (w.bits == 8)
    return w.half ? gemv_groups_vnni<true, 8, ROWS>(st, first, last) : gemv_groups_vnni<false, 8, ROWS>(st, first, last);
  return w.half ? gemv_groups_vnni<true, 4, ROWS>(st, first, last) : gemv_groups_vnni<false, 4, ROWS>(st, first, last);
}

void gemv_groups_vnni_any(const Step& st, int64_t first, int64_t last) {
  static_assert(kVnniPassRows == 4, "one instance per row count");
  switch (st.rows) {
    case 1: return gemv_groups_vnni_rows<1>(st, first, last);
    case 2: return gemv_groups_vnni_rows<2>(st, first, last);
    case 3: return gemv_groups_vnni_rows<3>(st, first, last);
    default: return gemv_groups_vnni_rows<4>(st, first, last);
  }
}
#endif

// M = 1 without VNNI: one 16-row group, on x centered per block (c_k = x_k - mean_b, Step::x):
//   y = sum_b scale_b * (sum_k c_k q_k) + mean_b * (scale_b * sum_k q_k + block_size * offset_b)
//       + offset_b * sum_k c_k,
// the second factor being the block's weight sum (sum_k c_k: Step::centered_sums). The same as sum_b scale_b * (sum_k x_k q_k)
// + offset_b * blocksum_b, whose two terms cancel when x has a large common part (an input of
// mean 50 lost 1.8e-5 to 6.9e-5 relative that way, against ~4e-7 for float32 x @ w); centered,
// the error is float32 x @ w's. The code sums ride on the adders, beside the multiply-adds.
template <bool HALF, int BITS>
void gemv_group(const Step& st, int64_t group) {
  constexpr int kColumns = BITS == 4 ? 8 : 4;
  const Packed& w = *st.w;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 block_size = _mm512_set1_ps(static_cast<float>(w.block_size));
  __m512 acc = _mm512_setzero_ps(), acc_means = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* p = w.block(group, b);
    const float* x = st.x + b * w.block_size;
    __m512 t[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 q[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t j = 0; j < w.chunks(); ++j) {
      const __m512i v = load_chunk(p + j * kChunkBytes);
      const int columns = static_cast<int>(std::min<int64_t>(kColumns, w.block_size - kColumns * j));
      for (int i = 0; i < columns; ++i) {   // columns kColumns * j + i: four chains
        const __m512 c = chunk_column<BITS>(v, i, table);
        t[i % 4] = _mm512_fmadd_ps(c, _mm512_set1_ps(x[kColumns * j + i]), t[i % 4]);
        q[i % 2] = _mm512_add_ps(q[i % 2], c);
      }
    }
    __m512 scale, offset;
    load_scale_offset<HALF>(w, p + w.code_bytes(), &scale, &offset);
    acc = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(t[0], t[1]), _mm512_add_ps(t[2], t[3])), scale, acc);
    const __m512 weight_sum = _mm512_fmadd_ps(scale, _mm512_add_ps(q[0], q[1]), _mm512_mul_ps(block_size, offset));
    acc_means = _mm512_fmadd_ps(weight_sum, _mm512_set1_ps(st.means[b]), acc_means);
    acc_means = _mm512_fmadd_ps(offset, _mm512_set1_ps(st.centered_sums[b]), acc_means);
  }
  _mm512_mask_storeu_ps(st.y + group * kLanes, lanes_mask(w, group), _mm512_add_ps(acc, acc_means));
}

// M > 1: GROUPS (1 or 2) groups from `group`, dequantized once per work item (up to
// kRowsPerItem rows of x) into a [K][GROUPS * 16] float32 panel, w = q * scale + offset (one
// rounding): 72-192 KB for SmolLM2's shapes, held in L2 while the row tiles read it.
template <int GROUPS, bool HALF, int BITS>
void dequantize_panel(const Packed& w, int64_t group, float* panel) {
  constexpr int kColumns = BITS == 4 ? 8 : 4;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t b = 0; b < w.nb; ++b)
    for (int g = 0; g < GROUPS; ++g) {
      const uint8_t* p = w.block(group + g, b);
      __m512 scale, offset;
      load_scale_offset<HALF>(w, p + w.code_bytes(), &scale, &offset);
      for (int64_t j = 0; j < w.chunks(); ++j) {
        const __m512i v = load_chunk(p + j * kChunkBytes);
        const int columns = static_cast<int>(std::min<int64_t>(kColumns, w.block_size - kColumns * j));
        for (int i = 0; i < columns; ++i)
          _mm512_storeu_ps(panel + ((b * w.block_size + kColumns * j + i) * GROUPS + g) * kLanes,
                           _mm512_fmadd_ps(chunk_column<BITS>(v, i, table), scale, offset));
      }
    }
}

// ROWS rows of x from r0 x the panel's GROUPS * 16 outputs (two groups: two multiply-adds per
// broadcast of x).
template <int ROWS, int GROUPS>
void panel_tile(const Step& st, const float* panel, int64_t r0, int64_t group) {
  const Packed& w = *st.w;
  __m512 acc[ROWS][GROUPS];
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_setzero_ps();
  const float* x = st.x + r0 * st.ldx;
  const int64_t width = w.nb * w.block_size;
  for (int64_t k = 0; k < width; ++k) {
    __m512 weight[GROUPS];
    for (int g = 0; g < GROUPS; ++g) weight[g] = _mm512_loadu_ps(panel + (k * GROUPS + g) * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * st.ldx + k]);
      for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_fmadd_ps(weight[g], xr, acc[r][g]);
    }
  }
  for (int g = 0; g < GROUPS; ++g) {
    const __mmask16 mask = lanes_mask(w, group + g);
    for (int r = 0; r < ROWS; ++r)
      _mm512_mask_storeu_ps(st.y + (r0 + r) * w.n + (group + g) * kLanes, mask, acc[r][g]);
  }
}

template <int GROUPS, bool HALF, int BITS>
void gemm_rows(const Step& st, int64_t r0, int64_t rows, int64_t group) {
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(st.w->nb * st.w->block_size * GROUPS * kLanes));
  dequantize_panel<GROUPS, HALF, BITS>(*st.w, group, panel.data());
  const float* p = panel.data();
  for (; rows >= kTileRows; rows -= kTileRows, r0 += kTileRows) panel_tile<kTileRows, GROUPS>(st, p, r0, group);
  switch (rows) {
    case 7: return panel_tile<7, GROUPS>(st, p, r0, group);
    case 6: return panel_tile<6, GROUPS>(st, p, r0, group);
    case 5: return panel_tile<5, GROUPS>(st, p, r0, group);
    case 4: return panel_tile<4, GROUPS>(st, p, r0, group);
    case 3: return panel_tile<3, GROUPS>(st, p, r0, group);
    case 2: return panel_tile<2, GROUPS>(st, p, r0, group);
    case 1: return panel_tile<1, GROUPS>(st, p, r0, group);
    default: return;
  }
}

template <bool HALF, int BITS>
void gemm_item(const Step& st, int64_t r0, int64_t rows, int64_t group) {
  if (group + 1 < st.w->groups) return gemm_rows<2, HALF, BITS>(st, r0, rows, group);
  return gemm_rows<1, HALF, BITS>(st, r0, rows, group);
}
#endif

#ifdef TRTLLM_LITE_AVX2
// AVX2 + FMA + F16C (no AVX-512): the same layout, each 64-byte chunk read as two 8-row halves
// (one 256-bit vector holds 8 rows x 4 bytes). Batch 1: integer sums of code pairs times x's
// int16 pairs (gemv_group_pairs_avx2); M > 1: the float32 panel and tiles of the AVX-512 build,
// a code becoming a float by a shift, a mask and a conversion (AVX2's vpermps takes only 8
// entries).
inline __m256i load_half_chunk(const uint8_t* chunk, int half) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * half));
}

// Column i of an 8-row half chunk as floats: 4-bit codes (columns 8j + i) or signed bytes (4j + i).
template <int BITS>
inline __m256 column_codes_avx2(__m256i half_chunk, int i) {
  if (BITS == 8) return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(half_chunk, 24 - 8 * i), 24));
  const __m256i shifted = kColumnShift[i] ? _mm256_srli_epi32(half_chunk, kColumnShift[i]) : half_chunk;
  const __m256i code = kColumnShift[i] == 28 ? shifted : _mm256_and_si256(shifted, _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(_mm256_xor_si256(code, _mm256_set1_epi32(kCodeXor4)));   // q (kCodeXor4)
}

// Rows [8 half, 8 half + 8) of a block's 16 scales and offsets.
template <bool HALF>
inline void load_scale_offset_avx2(const Packed& w, const uint8_t* p, int half, __m256* scale, __m256* offset) {
  if (HALF) {
    *scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * half)));
    *offset = w.offsets ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * half)))
                        : _mm256_setzero_ps();
  } else {
    *scale = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * half);
    *offset = w.offsets ? _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 16 + 8 * half) : _mm256_setzero_ps();
  }
}

// A 16-row group's outputs (two halves) into y, its first `lanes` rows.
inline void store_group_avx2(float* y, int64_t lanes, __m256 low, __m256 high) {
  if (lanes == kLanes) {
    _mm256_storeu_ps(y, low);
    _mm256_storeu_ps(y + 8, high);
    return;
  }
  alignas(32) float rows[kLanes];
  _mm256_store_ps(rows, low);
  _mm256_store_ps(rows + 8, high);
  std::memcpy(y, rows, sizeof(float) * static_cast<size_t>(lanes));
}

// Batch 1 (AVX2), integer form: x per block as 30-bit integers C = round(x * 2^s_b) (s_b puts the
// block's largest |x| in [2^29, 2^30)), split into two int16 planes, C = 2^15 hi + lo (lo in
// [0, 2^15)), laid out per chunk as the code pairs of pair_codes_avx2: [nb][chunks][2 planes][pairs]
// int32, each the two int16 x values of a pair of columns (4-bit: (0, 2), (4, 6), (1, 3), (5, 7) of
// the chunk's 8; 8-bit: (0, 2), (1, 3) of its 4), columns past the block's end 0. terms [nb][2]
// (float64): 2^-s_b and the block's sum of C (the kernel adds offset * sum_k x_k); a block with a
// NaN or infinity gets 2^-s_b NaN (its outputs NaN, as float32's). x is not centered (centering
// cost the codes' sum in every chunk, ~20% of the loop): the block's two terms,
// scale * sum_k C_k q_k and offset * sum_k C_k, cancel where x has a common part, so the kernel
// combines them in float64 (block_sum_pd), where they and their sum are exact but for 2^-53.
// Against float32: each x is within 2^-31 of the block's largest |x| (float32 rounds each to
// 2^-24 of its own); the sums are exact.
constexpr int kPairColumns4[4][2] = {{0, 2}, {4, 6}, {1, 3}, {5, 7}};
constexpr int kPairColumns8[2][2] = {{0, 2}, {1, 3}};

template <int BITS>
void x_pairs_avx2(const float* x, int64_t nb, int64_t block_size, int32_t* pairs, double* terms) {
  constexpr int kColumns = BITS == 4 ? 8 : 4, kPairs = kColumns / 2;
  const int64_t chunks = (block_size + kColumns - 1) / kColumns;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * block_size;
    int32_t* out = pairs + b * chunks * 2 * kPairs;
    float amax = 0.0f, probe = 0.0f;   // probe: NaN where x holds a NaN or an infinity (x * 0)
#pragma omp simd reduction(max : amax) reduction(+ : probe)
    for (int64_t i = 0; i < block_size; ++i) {
      amax = std::max(amax, std::fabs(xb[i]));
      probe += xb[i] * 0.0f;
    }
    double* term = terms + 2 * b;
    if (probe != 0.0f || !(amax <= std::numeric_limits<float>::max())) {   // NaN or infinity in x
      term[0] = std::numeric_limits<double>::quiet_NaN();
      term[1] = 0.0;
      std::fill(out, out + chunks * 2 * kPairs, 0);
      continue;
    }
    const int shift = 30 - exponent_of(amax), half = shift / 2;
    term[0] = std::ldexp(1.0, -shift);   // 2^-179 .. 2^97: one normal float64
    const float up1 = power_of_two(half), up2 = power_of_two(shift - half);
    thread_local std::vector<int32_t> c;   // the block's C, 0 past its end
    c.assign(static_cast<size_t>(chunks * kColumns), 0);
    int32_t* cb = c.data();
#pragma omp simd
    for (int64_t k = 0; k < block_size; ++k)   // |C| < 2^30; to nearest, ties to even (vcvtps2dq)
      cb[k] = static_cast<int32_t>(std::nearbyint(xb[k] * up1 * up2));
    int64_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < block_size; ++k) sum += cb[k];
    term[1] = static_cast<double>(sum);   // exact: |sum| < 2^44
    for (int64_t j = 0; j < chunks; ++j)
      for (int p = 0; p < kPairs; ++p) {
        const int* cols = BITS == 4 ? kPairColumns4[p] : kPairColumns8[p];
        const int32_t first = cb[j * kColumns + cols[0]], second = cb[j * kColumns + cols[1]];
        // C = 2^15 hi + lo, lo in [0, 2^15), hi = C >> 15 (arithmetic)
        const int32_t lo_a = first & 0x7FFF, hi_a = first >> 15, lo_b = second & 0x7FFF, hi_b = second >> 15;
        out[(j * 2 + 0) * kPairs + p] = static_cast<int32_t>(static_cast<uint32_t>(lo_a) | static_cast<uint32_t>(lo_b) << 16);
        out[(j * 2 + 1) * kPairs + p] =
            static_cast<int32_t>((static_cast<uint32_t>(hi_a) & 0xFFFF) | static_cast<uint32_t>(hi_b) << 16);
      }
  }
}

// An 8-row half chunk's codes as int16 pairs per row (32-bit lane), in x_pairs_avx2's pair order,
// sign-extended: 4-bit: the nibbles at bits 0/16, 4/20, 8/24, 12/28 (q - 8: kCodeXor4); 8-bit:
// bytes 0/2, 1/3.
template <int BITS>
inline void pair_codes_avx2(__m256i v, __m256i codes[4]) {
  if (BITS == 8) {
    codes[0] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
    codes[1] = _mm256_srai_epi16(v, 8);
    return;
  }
  codes[0] = _mm256_srai_epi16(_mm256_slli_epi16(v, 12), 12);
  codes[1] = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 12);
  codes[2] = _mm256_srai_epi16(_mm256_slli_epi16(v, 4), 12);
  codes[3] = _mm256_srai_epi16(v, 12);
}

// acc[0..1] (rows 0-3, 4-7 of an 8-row half) += (scale * (2^15 hi + lo) + offset * sum_c) * power
// in float64: the block's integer sums converted exactly, its two terms and their sum rounded at
// 2^-53, so they may cancel (x with a common part) and pass float32's range (huge weights, huge
// or tiny x) without loss. 4-bit codes are q - 8 (kCodeXor4): their offset is offset + 8 scale.
template <int BITS>
inline void block_sum_pd(__m256i lo, __m256i hi, __m256 scale, __m256 offset, __m256d sum_c, __m256d power,
                         __m256d acc[2]) {
  const __m256d two15 = _mm256_set1_pd(32768.0);
  for (int q = 0; q < 2; ++q) {
    const __m128i lo4 = q ? _mm256_extracti128_si256(lo, 1) : _mm256_castsi256_si128(lo);
    const __m128i hi4 = q ? _mm256_extracti128_si256(hi, 1) : _mm256_castsi256_si128(hi);
    const __m256d s = _mm256_cvtps_pd(q ? _mm256_extractf128_ps(scale, 1) : _mm256_castps256_ps128(scale));
    __m256d o = _mm256_cvtps_pd(q ? _mm256_extractf128_ps(offset, 1) : _mm256_castps256_ps128(offset));
    if (BITS == 4) o = _mm256_fmadd_pd(_mm256_set1_pd(8.0), s, o);   // codes q - 8 (kCodeXor4)
    const __m256d t = _mm256_fmadd_pd(_mm256_cvtepi32_pd(hi4), two15, _mm256_cvtepi32_pd(lo4));
    acc[q] = _mm256_fmadd_pd(_mm256_fmadd_pd(s, t, _mm256_mul_pd(o, sum_c)), power, acc[q]);
  }
}

// Rows [8 half, 8 half + 8) of a group's float64 sums as float32.
inline __m256 to_float_avx2(const __m256d acc[2]) {
  return _mm256_set_m128(_mm256_cvtpd_ps(acc[1]), _mm256_cvtpd_ps(acc[0]));
}

// M <= 4 (AVX2): one 16-row group on the int16 pairs of ROWS rows of x (x_pairs_avx2, one
// [nb * width] stretch per row): per block and 8-row half, vpmaddwd of each pair of codes by
// each plane's pair of x (products summed in pairs to int32: at most 2 x 2^15 x 15 (4-bit) or
// 2^7 (8-bit) x the block's pairs, never past int32 over a block of up to 2^14), then
// sum_k x_k w_k = (scale (2^15 A_hi + A_lo) + offset sum_k C_k) / 2^s_b in float64 (block_sum_pd),
// summed over blocks in float64 and rounded to float32 once. No float conversion per
// weight (the float32 loop's vcvtdq2ps, one per 8 weights a cycle on Zen 3), and the codes
// unpacked once for every row: with up to 4 rows the weights are read once, where the M > 1
// panel writes each as a float32 first.
template <bool HALF, int BITS, int ROWS>
void gemv_group_pairs_avx2(const Step& st, int64_t group) {
  constexpr int kPairs = BITS == 4 ? 4 : 2;
  const Packed& w = *st.w;
  const int64_t chunks = w.chunks(), block_bytes = w.block_bytes(), code_bytes = w.code_bytes();
  const int64_t row_pairs = w.nb * chunks * 2 * kPairs;   // one row's x_pairs_avx2 output
  __m256d acc[ROWS][2][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0][0] = acc[r][0][1] = acc[r][1][0] = acc[r][1][1] = _mm256_setzero_pd();
  const uint8_t* p = w.block(group, 0);
  for (int64_t b = 0; b < w.nb; ++b, p += block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + line + kPrefetchBytes), _MM_HINT_T1);
    const int32_t* xb = st.pairs + b * chunks * 2 * kPairs;
    for (int h = 0; h < 2; ++h) {
      __m256i a_lo[ROWS], a_hi[ROWS];
      for (int r = 0; r < ROWS; ++r) a_lo[r] = a_hi[r] = _mm256_setzero_si256();
      for (int64_t j = 0; j < chunks; ++j) {
        __m256i codes[4];
        pair_codes_avx2<BITS>(load_half_chunk(p + j * kChunkBytes, h), codes);
        for (int r = 0; r < ROWS; ++r) {
          const int32_t* xj = xb + r * row_pairs + j * 2 * kPairs;
          for (int c = 0; c < kPairs; ++c) {
            a_lo[r] = _mm256_add_epi32(a_lo[r], _mm256_madd_epi16(codes[c], _mm256_set1_epi32(xj[c])));
            a_hi[r] = _mm256_add_epi32(a_hi[r], _mm256_madd_epi16(codes[c], _mm256_set1_epi32(xj[kPairs + c])));
          }
        }
      }
      __m256 scale, offset;
      load_scale_offset_avx2<HALF>(w, p + code_bytes, h, &scale, &offset);
      for (int r = 0; r < ROWS; ++r) {
        const double* terms = st.block_terms + r * 2 * w.nb + 2 * b;
        block_sum_pd<BITS>(a_lo[r], a_hi[r], scale, offset, _mm256_set1_pd(terms[1]), _mm256_set1_pd(terms[0]),
                           acc[r][h]);
      }
    }
  }
  const int64_t lanes = std::min<int64_t>(kLanes, w.n - group * kLanes);
  for (int r = 0; r < ROWS; ++r)
    store_group_avx2(st.y + r * w.n + group * kLanes, lanes, to_float_avx2(acc[r][0]), to_float_avx2(acc[r][1]));
}

// M = 1 (AVX2): gemv_group_pairs_avx2's sums with both 8-row halves of a chunk in one pass, so
// each pair of x is broadcast once per chunk (not once per half), and every accumulator a named
// variable (held in a register: gemv_group_pairs_avx2's acc[ROWS][2], indexed by the half, went
// to the stack every block). Measured on SmolLM2 int4's layer linears (66 MB, 2 threads, Zen 3):
// 8.0 -> 6.9 ms.
template <bool HALF, int BITS>
void gemv_group_pairs1_avx2(const Step& st, int64_t group) {
  constexpr int kPairs = BITS == 4 ? 4 : 2;
  const Packed& w = *st.w;
  const int64_t chunks = w.chunks(), block_bytes = w.block_bytes(), code_bytes = w.code_bytes();
  __m256d acc0[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()}, acc1[2] = {acc0[0], acc0[1]};
  const uint8_t* p = w.block(group, 0);
  for (int64_t b = 0; b < w.nb; ++b, p += block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + line + kPrefetchBytes), _MM_HINT_T1);
    const int32_t* xj = st.pairs + b * chunks * 2 * kPairs;
    __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
    for (int64_t j = 0; j < chunks; ++j, xj += 2 * kPairs) {
      __m256i codes0[4], codes1[4];
      pair_codes_avx2<BITS>(load_half_chunk(p + j * kChunkBytes, 0), codes0);
      pair_codes_avx2<BITS>(load_half_chunk(p + j * kChunkBytes, 1), codes1);
      for (int c = 0; c < kPairs; ++c) {
        const __m256i x_lo = _mm256_set1_epi32(xj[c]), x_hi = _mm256_set1_epi32(xj[kPairs + c]);
        lo0 = _mm256_add_epi32(lo0, _mm256_madd_epi16(codes0[c], x_lo));
        hi0 = _mm256_add_epi32(hi0, _mm256_madd_epi16(codes0[c], x_hi));
        lo1 = _mm256_add_epi32(lo1, _mm256_madd_epi16(codes1[c], x_lo));
        hi1 = _mm256_add_epi32(hi1, _mm256_madd_epi16(codes1[c], x_hi));
      }
    }
    const double* terms = st.block_terms + 2 * b;
    const __m256d power = _mm256_set1_pd(terms[0]), sum_c = _mm256_set1_pd(terms[1]);
    __m256 scale0, offset0, scale1, offset1;
    load_scale_offset_avx2<HALF>(w, p + code_bytes, 0, &scale0, &offset0);
    load_scale_offset_avx2<HALF>(w, p + code_bytes, 1, &scale1, &offset1);
    block_sum_pd<BITS>(lo0, hi0, scale0, offset0, sum_c, power, acc0);
    block_sum_pd<BITS>(lo1, hi1, scale1, offset1, sum_c, power, acc1);
  }
  const int64_t lanes = std::min<int64_t>(kLanes, w.n - group * kLanes);
  store_group_avx2(st.y + group * kLanes, lanes, to_float_avx2(acc0), to_float_avx2(acc1));
}

template <bool HALF, int BITS>
void gemv_rows_pairs_avx2(const Step& st, int64_t group) {
  switch (st.rows) {
    case 1: return gemv_group_pairs1_avx2<HALF, BITS>(st, group);
    case 2: return gemv_group_pairs_avx2<HALF, BITS, 2>(st, group);
    case 3: return gemv_group_pairs_avx2<HALF, BITS, 3>(st, group);
    default: return gemv_group_pairs_avx2<HALF, BITS, 4>(st, group);
  }
}

// M > 1 (AVX2): one group dequantized into a [K][16] float32 panel, w = q * scale + offset (one
// rounding, as dequantize_panel), then register tiles of up to 6 rows of x x 16 outputs.
template <bool HALF, int BITS>
void dequantize_panel_avx2(const Packed& w, int64_t group, float* panel) {
  constexpr int kColumns = BITS == 4 ? 8 : 4;
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* p = w.block(group, b);
    for (int h = 0; h < 2; ++h) {
      __m256 scale, offset;
      load_scale_offset_avx2<HALF>(w, p + w.code_bytes(), h, &scale, &offset);
      for (int64_t j = 0; j < w.chunks(); ++j) {
        const __m256i v = load_half_chunk(p + j * kChunkBytes, h);
        const int columns = static_cast<int>(std::min<int64_t>(kColumns, w.block_size - kColumns * j));
        for (int i = 0; i < columns; ++i)
          _mm256_storeu_ps(panel + (b * w.block_size + kColumns * j + i) * kLanes + 8 * h,
                           _mm256_fmadd_ps(column_codes_avx2<BITS>(v, i), scale, offset));
      }
    }
  }
}

constexpr int kTileRowsAvx2 = 6;   // 12 accumulators + 2 weights + x's broadcast: 15 of 16 registers

// ROWS (1-6) rows of x from r0 x the panel's 16 outputs. The accumulators are named: as an array,
// GCC stored its vectors to the stack every k, which bound the loop at ~1/3 of the
// multiply-adds' rate.
template <int ROWS>
void panel_tile_avx2(const Step& st, const float* panel, int64_t r0, int64_t group) {
  static_assert(ROWS >= 1 && ROWS <= kTileRowsAvx2, "a tile is 1-6 rows");
  const Packed& w = *st.w;
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const int64_t ldx = st.ldx;
  const float* x = st.x + r0 * ldx;
  const int64_t width = w.nb * w.block_size;
  for (int64_t k = 0; k < width; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kLanes), w1 = _mm256_loadu_ps(panel + k * kLanes + 8);
    auto row = [&](int r, __m256& low, __m256& high) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
      low = _mm256_fmadd_ps(w0, xr, low);
      high = _mm256_fmadd_ps(w1, xr, high);
    };
    row(0, a00, a01);
    if (ROWS > 1) row(1, a10, a11);
    if (ROWS > 2) row(2, a20, a21);
    if (ROWS > 3) row(3, a30, a31);
    if (ROWS > 4) row(4, a40, a41);
    if (ROWS > 5) row(5, a50, a51);
  }
  const int64_t lanes = std::min<int64_t>(kLanes, w.n - group * kLanes);
  float* y = st.y + r0 * w.n + group * kLanes;
  store_group_avx2(y, lanes, a00, a01);
  if (ROWS > 1) store_group_avx2(y + w.n, lanes, a10, a11);
  if (ROWS > 2) store_group_avx2(y + 2 * w.n, lanes, a20, a21);
  if (ROWS > 3) store_group_avx2(y + 3 * w.n, lanes, a30, a31);
  if (ROWS > 4) store_group_avx2(y + 4 * w.n, lanes, a40, a41);
  if (ROWS > 5) store_group_avx2(y + 5 * w.n, lanes, a50, a51);
}

template <bool HALF, int BITS>
void gemm_rows_avx2(const Step& st, int64_t r0, int64_t rows, int64_t group) {
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>(st.w->nb * st.w->block_size * kLanes));
  dequantize_panel_avx2<HALF, BITS>(*st.w, group, panel.data());
  const float* p = panel.data();
  for (; rows >= kTileRowsAvx2; rows -= kTileRowsAvx2, r0 += kTileRowsAvx2) panel_tile_avx2<kTileRowsAvx2>(st, p, r0, group);
  switch (rows) {
    case 5: return panel_tile_avx2<5>(st, p, r0, group);
    case 4: return panel_tile_avx2<4>(st, p, r0, group);
    case 3: return panel_tile_avx2<3>(st, p, r0, group);
    case 2: return panel_tile_avx2<2>(st, p, r0, group);
    case 1: return panel_tile_avx2<1>(st, p, r0, group);
    default: return;
  }
}
#endif

// Portable loops (neither AVX-512 nor AVX2): the dequantized weight, one output at a time.
float scale_at(const Packed& w, const uint8_t* p, int lane) {
  const uint8_t* s = p + w.code_bytes();
  if (w.half) {
    uint16_t h;
    std::memcpy(&h, s + 2 * lane, 2);
    return half_to_float(h);
  }
  float f;
  std::memcpy(&f, s + 4 * lane, 4);
  return f;
}

float offset_at(const Packed& w, const uint8_t* p, int lane) {
  return w.offsets ? scale_at(w, p + w.scale_bytes(), lane) : 0.0f;
}

[[maybe_unused]] void portable_rows(const Step& st, int64_t r0, int64_t rows, int64_t group) {
  const Packed& w = *st.w;
  const int lanes = static_cast<int>(std::min<int64_t>(kLanes, w.n - group * kLanes));
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int lane = 0; lane < lanes; ++lane) {
      float total = 0.0f;
      for (int64_t b = 0; b < w.nb; ++b) {
        const uint8_t* p = w.block(group, b);
        const float scale = scale_at(w, p, lane), offset = offset_at(w, p, lane);
        const float* x = st.x + r * st.ldx + b * w.block_size;
        for (int64_t k = 0; k < w.block_size; ++k)
          total += x[k] * std::fma(static_cast<float>(code_at(w, p, lane, k)), scale, offset);
      }
      st.y[r * w.n + group * kLanes + lane] = total;
    }
  }
}

// Rows of x the batch-1 loops take in one pass over the weights: 1, or up to 4 on AVX2
// (gemv_group_pairs_avx2) and with VNNI (gemv_groups_vnni); more take the M > 1 panel.
#ifdef TRTLLM_LITE_AVX2
constexpr int64_t kPairRowsAvx2 = 4;
inline bool gemv_rows(const Step& st) { return st.rows <= kPairRowsAvx2; }
#elif defined(TRTLLM_LITE_VNNI)
inline bool gemv_rows(const Step& st) { return st.rows <= kVnniPassRows; }
#else
inline bool gemv_rows(const Step& st) { return st.rows == 1; }
#endif

// Work items: batch 1 (gemv_rows), one group each; else kRowsPerItem rows x a pair of groups each.
int64_t group_items(const Step& st) { return gemv_rows(st) ? st.w->groups : (st.w->groups + 1) / 2; }

#if defined(TRTLLM_LITE_VNNI) || defined(TRTLLM_LITE_AVX2)
// A number for each batch-1 pass over a node's weights (Step::call; 0: none yet).
uint64_t next_pass() {
  static std::atomic<uint64_t> passes{0};
  return passes.fetch_add(1, std::memory_order_relaxed) + 1;
}

// The batch-1 step (gemv_rows) as the calling thread's work items read it: x's integer forms for
// st.rows rows from st.x (VNNI: integer_planes' planes, means, factors and sums; AVX2:
// x_pairs_avx2's pairs and terms) in buffers of this thread's own, made once a pass (st.call)
// however many of its items the thread runs. Each thread makes them from x rather than reading
// ones made by the node's caller, which both threads' loops read every linear: made that way, a
// 576-wide x's planes took 1.6 us in a SmolLM2 int4 batch-1 step (2-core Zen 4 VM), into
// buffers that one core alone writes and reads each linear 0.47 us (docs/benchmarks.md,
// session 38); and the threads make them at once, not one while the other waits. The step
// 1.06x, 1.07-1.09x at 4-8 sequences.
Step own_x_step(const Step& st) {
  thread_local uint64_t made_for = 0;
  const Packed& w = *st.w;
  const int64_t nb = w.nb, rows = st.rows;
  const auto size = [](int64_t n) { return static_cast<size_t>(n); };
  Step mine = st;
#ifdef TRTLLM_LITE_VNNI
  thread_local std::vector<float> means, centered_sums, factors;
  thread_local std::vector<uint8_t> planes;
  const int64_t row_planes = nb * kPlanes * w.width();
  if (made_for != st.call) {
    made_for = 0;   // (until every row is made)
    means.resize(size(rows * nb));
    centered_sums.resize(size(rows * nb));
    planes.resize(size(rows * row_planes));
    factors.resize(size(rows * 2 * nb));
    for (int64_t r = 0; r < rows; ++r)
      integer_planes(st.x + r * st.ldx, nb, w.block_size, w.width(), means.data() + r * nb,
                     planes.data() + r * row_planes, factors.data() + r * 2 * nb, centered_sums.data() + r * nb);
    made_for = st.call;
  }
  mine.means = means.data();
  mine.centered_sums = centered_sums.data();
  mine.planes = planes.data();
  mine.factors = factors.data();
#else
  thread_local std::vector<int32_t> pairs;
  thread_local std::vector<double> block_terms;
  const int64_t row_pairs = nb * w.width();
  if (made_for != st.call) {
    made_for = 0;
    pairs.resize(size(rows * row_pairs));
    block_terms.resize(size(rows * 2 * nb));
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = st.x + r * st.ldx;
      if (w.bits == 8)
        x_pairs_avx2<8>(xr, nb, w.block_size, pairs.data() + r * row_pairs, block_terms.data() + r * 2 * nb);
      else
        x_pairs_avx2<4>(xr, nb, w.block_size, pairs.data() + r * row_pairs, block_terms.data() + r * 2 * nb);
    }
    made_for = st.call;
  }
  mine.pairs = pairs.data();
  mine.block_terms = block_terms.data();
#endif
  return mine;
}
#endif

void run_item(void* user, size_t item) {
  const Step& st = *static_cast<const Step*>(user);
  const Packed& w = *st.w;
  const int64_t per_row_chunk = group_items(st);
  const int64_t r0 = static_cast<int64_t>(item) / per_row_chunk * kRowsPerItem;
  const int64_t rows = std::min(kRowsPerItem, st.rows - r0);
#ifdef __AVX512F__
  // the loops for this node's layout: float16 or float32 scales, 4- or 8-bit codes
  if (gemv_rows(st)) {
    const int64_t group = static_cast<int64_t>(item);
#ifdef TRTLLM_LITE_VNNI
    // item: a contiguous range of groups
    const int64_t first = w.groups * group / st.range_items, last = w.groups * (group + 1) / st.range_items;
    return gemv_groups_vnni_any(own_x_step(st), first, last);
#else
    if (w.bits == 8) return w.half ? gemv_group<true, 8>(st, group) : gemv_group<false, 8>(st, group);
    return w.half ? gemv_group<true, 4>(st, group) : gemv_group<false, 4>(st, group);
#endif
  }
  const int64_t group = static_cast<int64_t>(item) % per_row_chunk * 2;
  if (w.bits == 8) return w.half ? gemm_item<true, 8>(st, r0, rows, group) : gemm_item<false, 8>(st, r0, rows, group);
  return w.half ? gemm_item<true, 4>(st, r0, rows, group) : gemm_item<false, 4>(st, r0, rows, group);
#else
  const int64_t group = gemv_rows(st) ? static_cast<int64_t>(item) : static_cast<int64_t>(item) % per_row_chunk * 2;
#ifdef TRTLLM_LITE_AVX2
  if (gemv_rows(st)) {
    const Step mine = own_x_step(st);
    if (w.bits == 8) return w.half ? gemv_rows_pairs_avx2<true, 8>(mine, group) : gemv_rows_pairs_avx2<false, 8>(mine, group);
    return w.half ? gemv_rows_pairs_avx2<true, 4>(mine, group) : gemv_rows_pairs_avx2<false, 4>(mine, group);
  }
  for (int64_t g = group; g < std::min(w.groups, group + 2); ++g) {
    if (w.bits == 8) w.half ? gemm_rows_avx2<true, 8>(st, r0, rows, g) : gemm_rows_avx2<false, 8>(st, r0, rows, g);
    else w.half ? gemm_rows_avx2<true, 4>(st, r0, rows, g) : gemm_rows_avx2<false, 4>(st, r0, rows, g);
  }
#else
  for (int64_t g = group; g < std::min(w.groups, group + (st.rows == 1 ? 1 : 2)); ++g) portable_rows(st, r0, rows, g);
#endif
#endif
}

struct Kernel : KernelBase {
  bool with_offsets = false;
  int64_t n = 0, kernel_k = 0, block_size = 0;
  bool split8 = false;      // QuantizedLinearSplit8: a split 8-bit weight, x [M, K / 2] (file comment)
  std::mutex mutex;
  std::array<const void*, 4> packed_from{};   // the weight inputs' data `packed` was made from
  std::array<Dims, 4> packed_dims{};          // and their shapes
  size_t num_weights() const { return with_offsets ? 4 : 3; }
  std::string description() const {   // for errors: the op and its attributes
    return std::string(split8 ? "QuantizedLinearSplit8" : with_offsets ? "QuantizedLinearWithOffsets" : "QuantizedLinear") +
           " (N " + std::to_string(n) + ", K " + std::to_string(kernel_k) + ", block_size " + std::to_string(block_size) + ")";
  }
  Packed packed;
  OrtStatus* compute(OrtKernelContext* context) override;
  OrtStatus* check_and_pack(OrtKernelContext* context);
  OrtStatus* pack(const uint8_t* qweight, const float* scales, const uint8_t* zero_points, const float* offsets,
                  int64_t nbo);
  OrtStatus* pack_split(const uint8_t* qweight, const std::vector<float>& scale, const std::vector<float>& offset);
};

// Row `lane`'s scale and offset after a repacked block's codes (float16 where w.half).
// (No offset is stored where the layout has none: w.offsets false, every offset 0.)
void store_scale_offset(const Packed& w, uint8_t* block, int64_t lane, float scale, float offset) {
  uint8_t* s = block + w.code_bytes();
  if (w.half) {
    uint16_t hs = 0, ho = 0;
    float_to_half_exact(scale, &hs);
    float_to_half_exact(offset, &ho);
    std::memcpy(s + 2 * lane, &hs, 2);
    if (w.offsets) std::memcpy(s + 2 * kLanes + 2 * lane, &ho, 2);
  } else {
    std::memcpy(s + 4 * lane, &scale, 4);
    if (w.offsets) std::memcpy(s + 4 * kLanes + 4 * lane, &offset, 4);
  }
}

// Whether any folded offset is nonzero (else the layout stores none: Packed::offsets).
bool any_offset(const std::vector<float>& offset) {
  for (const float o : offset)
    if (o != 0.0f) return true;
  return false;
}

// The repacked layout (file comment) from MatMulNBits' tensors; offsets folded per block:
// offset[n, b] = (b < nbo ? offsets[n, b] : 0) - scale[n, b] * zero_point[n, b] (offsets may be null).
OrtStatus* Kernel::pack(const uint8_t* qweight, const float* scales, const uint8_t* zero_points,
                        const float* offsets, int64_t nbo) {
  Packed& w = packed;
  w.n = n;
  w.block_size = block_size;
  w.nb = (kernel_k + block_size - 1) / block_size;
  w.groups = (n + kLanes - 1) / kLanes;
  const int64_t zp_row = (w.nb + 1) / 2;
  std::vector<float> scale(static_cast<size_t>(n * w.nb)), offset(scale.size());
  w.half = true;
  for (int64_t row = 0; row < n; ++row)
    for (int64_t b = 0; b < w.nb; ++b) {
      const uint8_t zp_byte = zero_points[row * zp_row + b / 2];
      const float z = static_cast<float>(b % 2 ? zp_byte >> 4 : zp_byte & 15);
      const float s = scales[row * w.nb + b];
      const float o = (b < nbo ? offsets[row * nbo + b] : 0.0f) - s * z;   // nbo 0 without offsets
      scale[row * w.nb + b] = s;
      offset[row * w.nb + b] = o;
      uint16_t h;
      w.half = w.half && float_to_half_exact(s, &h) && float_to_half_exact(o, &h);
    }
  if (split8) return pack_split(qweight, scale, offset);
  w.bits = 4;
  w.offsets = any_offset(offset);
  if (!w.data.assign(static_cast<size_t>(w.groups * w.nb * w.block_bytes())))   // zeroed: code 0 past a block's end
    return error(ORT_FAIL, description() + ": out of memory for the repacked weights");
  const int64_t pairs = block_size / 2;
  for (int64_t row = 0; row < n; ++row) {
    const int64_t group = row / kLanes, lane = row % kLanes;
    for (int64_t b = 0; b < w.nb; ++b) {
      uint8_t* p = const_cast<uint8_t*>(w.block(group, b));
      const uint8_t* codes = qweight + (row * w.nb + b) * pairs;   // byte i: columns 2i (low nibble), 2i + 1
      for (int64_t k = 0; k < block_size; ++k) {
        const int code = (k % 2 ? codes[k / 2] >> 4 : codes[k / 2] & 15) ^ kCodeXor4;
        p[k / 8 * kChunkBytes + lane * 4 + k % 4] |= static_cast<uint8_t>(k % 8 < 4 ? code : code << 4);
      }
      store_scale_offset(w, p, lane, scale[row * w.nb + b], offset[row * w.nb + b]);
    }
  }
  return nullptr;
}

// A split 8-bit weight (builder/quantize.py split_8bit) recombined into the 8-bit layout: of
// the 2 nb 4-bit blocks per row, block b holds the high nibbles h (scale 16 s), block nb + b the
// low ones l (scale s), so with u = 16 h + l the weight is s * (u - 128) + offset8, offset8 =
// offset[b] + offset[nb + b] + 128 s (the folded offsets of both halves). Codes are stored as
// the signed bytes u - 128. `scale` / `offset`: the 4-bit blocks' ([N, 2 nb], Kernel::pack).
OrtStatus* Kernel::pack_split(const uint8_t* qweight, const std::vector<float>& scale,
                              const std::vector<float>& offset) {
  Packed& w = packed;
  const int64_t nb4 = w.nb, nb = nb4 / 2;
  w.bits = 8;
  w.nb = nb;
  std::vector<float> scale8(static_cast<size_t>(n * nb)), offset8(scale8.size());
  w.half = true;
  for (int64_t row = 0; row < n; ++row)
    for (int64_t b = 0; b < nb; ++b) {
      const float high = scale[row * nb4 + b], low = scale[row * nb4 + nb + b];
      if (high != 16.0f * low)
        return error(ORT_INVALID_ARGUMENT, description() + ": row " + std::to_string(row) + ", block " +
                                               std::to_string(b) + ": the high half's scale is not 16x the low half's");
      const double o = static_cast<double>(offset[row * nb4 + b]) + offset[row * nb4 + nb + b] + 128.0 * low;
      scale8[row * nb + b] = low;
      offset8[row * nb + b] = static_cast<float>(o);
      uint16_t h;
      w.half = w.half && float_to_half_exact(low, &h) && float_to_half_exact(offset8[row * nb + b], &h);
    }
  w.offsets = any_offset(offset8);
  if (!w.data.assign(static_cast<size_t>(w.groups * w.nb * w.block_bytes())))
    return error(ORT_FAIL, description() + ": out of memory for the repacked weights");
  const int64_t pairs = block_size / 2;
  auto code4 = [&](int64_t row, int64_t b, int64_t k) {
    const uint8_t byte = qweight[(row * nb4 + b) * pairs + k / 2];
    return k % 2 ? byte >> 4 : byte & 15;
  };
  for (int64_t row = 0; row < n; ++row) {
    const int64_t group = row / kLanes, lane = row % kLanes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* p = const_cast<uint8_t*>(w.block(group, b));
      for (int64_t k = 0; k < block_size; ++k) {
        const int u = 16 * code4(row, b, k) + code4(row, nb + b, k);
        p[k / 4 * kChunkBytes + lane * 4 + k % 4] = static_cast<uint8_t>(static_cast<int8_t>(u - 128));
      }
      store_scale_offset(w, p, lane, scale8[row * nb + b], offset8[row * nb + b]);
    }
  }
  return nullptr;
}

// The weights' shapes checked against the attributes, then repacked (layout above).
OrtStatus* Kernel::check_and_pack(OrtKernelContext* context) {
  Tensor qweight, scales, zero_points, offsets;
  RETURN_IF_ERROR(read_input(context, 1, &qweight));
  RETURN_IF_ERROR(read_input(context, 2, &scales));
  RETURN_IF_ERROR(read_input(context, 3, &zero_points));
  if (with_offsets) RETURN_IF_ERROR(read_input(context, 4, &offsets));
  const int64_t nb = block_size > 0 ? (kernel_k + block_size - 1) / block_size : 0;
  auto count = [](const Tensor& t) {
    int64_t c = 1;
    for (int64_t d : t.dims) c *= d;
    return c;
  };
  const int64_t nbo = !with_offsets ? 0 : offsets.dims.size() == 2 ? offsets.dims[1] : -1;
  if (n <= 0 || block_size <= 0 || block_size % 4 || count(qweight) != n * nb * block_size / 2 ||
      count(scales) != n * nb || count(zero_points) != n * ((nb + 1) / 2) ||
      (with_offsets && (offsets.dims.size() != 2 || offsets.dims[0] != n || nbo < 0 || nbo * block_size > kernel_k)))
    return error(ORT_INVALID_ARGUMENT,
                 description() + ": qweight " + dims_string(qweight.dims) + ", scales " +
                     dims_string(scales.dims) + ", zero_points " + dims_string(zero_points.dims) +
                     (with_offsets ? ", offsets " + dims_string(offsets.dims) : "") +
                     " are not [N, nb, block_size / 2], [N, nb], [N, ceil(nb / 2)]" +
                     (with_offsets ? ", [N, nbo <= K / block_size]" : "") +
                     " (nb = ceil(K / block_size), block_size a multiple of 4)");
  if (split8 && kernel_k % (2 * block_size))
    return error(ORT_INVALID_ARGUMENT, description() + ": a split 8-bit weight needs K a multiple of 2 x block_size");
  if (split8 && nbo != nb / 2)
    return error(ORT_INVALID_ARGUMENT, description() + ": a split 8-bit weight needs offsets [N, " +
                                           std::to_string(nb / 2) + "] (K / 2 / block_size), got " +
                                           dims_string(offsets.dims));
  const uint8_t *q = nullptr, *z = nullptr;
  const float *s = nullptr, *o = nullptr;
  RETURN_IF_ERROR(data_of(qweight, &q));
  RETURN_IF_ERROR(data_of(scales, &s));
  RETURN_IF_ERROR(data_of(zero_points, &z));
  if (with_offsets) RETURN_IF_ERROR(data_of(offsets, &o));
  packed_from = {};   // until the repack succeeds
  RETURN_IF_ERROR(pack(q, s, z, o, nbo));
  packed_from = {q, s, z, o};
  packed_dims = {qweight.dims, scales.dims, zero_points.dims, offsets.dims};
  return nullptr;
}

OrtStatus* run_gemv(OrtKernelContext* context, Step& st);

OrtStatus* Kernel::compute(OrtKernelContext* context) {
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  const int64_t x_width = split8 ? kernel_k / 2 : kernel_k;   // a split 8-bit weight's x comes once
  if (x.dims.size() != 2 || x.dims[1] != x_width)
    return error(ORT_INVALID_ARGUMENT, description() + ": x " + dims_string(x.dims) + " is not [M, " +
                                           (split8 ? "K / 2" : "K") + "]");
  const float* x_data = nullptr;
  RETURN_IF_ERROR(data_of(x, &x_data));
  {
    // the weights are constants: their shapes are checked and the data repacked at the first
    // call, or when a weight input's data or shape changes (a weight fed as a graph input can
    // keep its address with another shape: QA, session 32)
    std::lock_guard<std::mutex> lock(mutex);
    bool same = true;
    for (size_t i = 0; i < num_weights(); ++i) {
      Tensor weight;
      const void* data = nullptr;
      RETURN_IF_ERROR(read_input(context, i + 1, &weight));
      RETURN_IF_ERROR(data_of(weight, &data));
      same = same && data == packed_from[i] && weight.dims == packed_dims[i];
    }
    if (!same) RETURN_IF_ERROR(check_and_pack(context));
  }
  Step st{};
  st.w = &packed;
  st.rows = x.dims[0];
  RETURN_IF_ERROR(new_output(context, 0, {st.rows, n}, &st.y));
  if (st.rows == 0) return nullptr;
  // x zero-padded to whole blocks where K is not a multiple of the block size
  const int64_t nb = packed.nb, width = nb * block_size;
  thread_local std::vector<float> x_buffer, means, centered, centered_sums;
  st.x = x_data;
  st.ldx = x_width;
  if (width != x_width) {
    x_buffer.assign(static_cast<size_t>(st.rows * width), 0.0f);
    for (int64_t r = 0; r < st.rows; ++r)
      std::memcpy(x_buffer.data() + r * width, x_data + r * kernel_k, sizeof(float) * kernel_k);
    st.x = x_buffer.data();
    st.ldx = width;
  }
#ifdef TRTLLM_LITE_VNNI
  // up to kVnniGemvRows rows: x's integer planes (gemv_groups_vnni), in passes of up to
  // kVnniPassRows rows over the weights; the M > 1 panels dequantize every weight to float32
  // each step, which cost SmolLM2 int4 ~4x a batch-1 step at 4 sequences (TPOT 4.3 -> 18.6 ms on
  // a Xeon VM, 4.9 -> 24.4 on Zen 4)
  if (st.rows <= kVnniGemvRows) {
    const int64_t rows = st.rows, pass = std::min(rows, kVnniPassRows);
    const float* x_rows = st.x;
    float* y_rows = st.y;
    for (int64_t r0 = 0; r0 < rows; r0 += pass) {   // each work item makes its thread's planes (own_x_step)
      st.rows = std::min(pass, rows - r0);
      st.x = x_rows + r0 * st.ldx;
      st.y = y_rows + r0 * n;
      st.call = next_pass();
      RETURN_IF_ERROR(run_gemv(context, st));
    }
    return nullptr;
  }
#elif defined(__AVX512F__)
  // M = 1: x centered per block (gemv_group; the portable loops take x as it is)
  if (st.rows == 1) {
    means.resize(static_cast<size_t>(nb));
    centered_sums.resize(static_cast<size_t>(nb));
    centered.resize(static_cast<size_t>(width));
    st.means = means.data();
    st.centered_sums = centered_sums.data();
    center_blocks(st.x, nb, block_size, means.data(), centered.data(), centered_sums.data());
    st.x = centered.data();
    return run_gemv(context, st);
  }
#endif
#ifdef TRTLLM_LITE_AVX2
  if (gemv_rows(st)) st.call = next_pass();   // each work item makes its thread's int16 pairs (own_x_step)
#endif
  return run_gemv(context, st);
}

// The step's work items on the intra-op threads (run_item).
OrtStatus* run_gemv(OrtKernelContext* context, Step& st) {
  const Packed& packed = *st.w;
  const int64_t row_items = gemv_rows(st) ? 1 : (st.rows + kRowsPerItem - 1) / kRowsPerItem;
  int64_t items = row_items * group_items(st);
  // one thread below ~64 KiB of weights at batch 1 (waking the pool costs more than it saves)
  const bool serial = st.rows * packed.groups * packed.nb * packed.block_bytes() < (64 << 10);
#ifdef TRTLLM_LITE_VNNI
  if (gemv_rows(st)) items = st.range_items = serial ? 1 : std::min(packed.groups, static_cast<int64_t>(available_cores()));
#endif
  // even items: one contiguous range of groups per core
  return parallel_for(context, run_item, static_cast<size_t>(items), &st, serial,
                      std::min(static_cast<size_t>(items), available_cores()));
}

template <bool WITH_OFFSETS, bool SPLIT8>
OrtStatus* create_kernel(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<Kernel>(kernel, [info](Kernel& k) {
    k.with_offsets = WITH_OFFSETS;
    k.split8 = SPLIT8;
    RETURN_IF_ERROR(int_attribute(info, "N", &k.n));
    RETURN_IF_ERROR(int_attribute(info, "K", &k.kernel_k));
    return int_attribute(info, "block_size", &k.block_size);
  });
}

}  // namespace

KernelBase* new_quantized_linear(int64_t n, int64_t k, int64_t block_size, bool with_offsets, bool split8) {
  Kernel* kernel = new Kernel();
  kernel->n = n;
  kernel->kernel_k = k;
  kernel->block_size = block_size;
  kernel->with_offsets = with_offsets || split8;
  kernel->split8 = split8;
  return kernel;
}

const OrtCustomOp* quantized_linear_op() {
  static const CustomOp op({"QuantizedLinear", kInputs, 4, 1, create_kernel<false, false>});
  return &op;
}

const OrtCustomOp* quantized_linear_with_offsets_op() {
  static const CustomOp op({"QuantizedLinearWithOffsets", kInputs, 6, 1, create_kernel<true, false>});
  return &op;
}

const OrtCustomOp* quantized_linear_split8_op() {
  static const CustomOp op({"QuantizedLinearSplit8", kInputs, 6, 1, create_kernel<true, true>});
  return &op;
}

}  // namespace trtllm_lite_kernels
