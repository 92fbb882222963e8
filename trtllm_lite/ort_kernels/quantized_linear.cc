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
// (the first call) so that a vector holds 16 output rows of one input column:
//
//   per 16-row group, per block: codes [block_size / 2][16] bytes (k-pair major), then the
//   block's scale and offset for the 16 rows (float16 when every value is exact there, as
//   GGUF's are; float32 otherwise), offset = offsets - scale * zero_point (zero points folded).
//
// A 4-bit code becomes a float by one permute: vpermps reads the low 4 bits of each index
// lane, so the 16-entry table {0, 1, ..., 15} turns codes into floats without masking or
// converting (the high nibble: a shift first). No horizontal sums: the 16 lanes are 16
// outputs.
//   M = 1 (memory-bound): per block t = sum_k c_k q[:, k] (c: x centered per block, broadcast;
//     16 rows a vector), y += scale * t + mean(x) * (the block's weight sum): a few vector ops
//     per 32 weights.
//   M > 1 (compute-bound as M grows): w = q * scale + offset (the dequantized float32 weight,
//     one rounding), then a register tile of up to 8 rows of x x 32 outputs (two groups).
#include <array>
#include <cstdint>
#include <mutex>

#include "kernel_common.h"

namespace trtllm_lite_kernels {
namespace {

constexpr ONNXTensorElementDataType kU8 = static_cast<ONNXTensorElementDataType>(2);   // uint8
constexpr ONNXTensorElementDataType kInputs[6] = {kF32, kU8, kF32, kU8, kF32, kF32};   // (4 without offsets)
constexpr int64_t kLanes = 16;      // output rows per group (one float32 vector)
constexpr int64_t kTileRows = 8;    // rows of x per register tile (M > 1)
constexpr int64_t kRowsPerItem = 64;

// One node's weights, repacked (layout above).
struct Packed {
  int64_t n = 0, nb = 0, block_size = 0, groups = 0;
  bool half = false;                 // scales and offsets stored as float16
  std::vector<uint8_t> data;
  int64_t code_bytes() const { return block_size * kLanes / 2; }
  int64_t block_bytes() const { return code_bytes() + 2 * kLanes * (half ? 2 : 4); }
  const uint8_t* block(int64_t group, int64_t b) const { return data.data() + (group * nb + b) * block_bytes(); }
};

struct Step {
  const Packed* w;
  const float* x;      // [M, ldx >= nb * block_size]: x, zero-padded to whole blocks if needed
  const float* means;  // M = 1 (AVX-512 build): [nb] block means of x, which x then holds
                       // centered per block (gemv_group)
  float* y;            // [M, N]
  int64_t rows, ldx;
};

#ifdef __AVX512F__
inline __m512 codes_low(__m512i c, __m512 table) { return _mm512_permutexvar_ps(c, table); }
inline __m512 codes_high(__m512i c, __m512 table) { return _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table); }
inline __m512i load_codes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <bool HALF>
inline void load_scale_offset(const uint8_t* p, __m512* scale, __m512* offset) {
  if (HALF) {
    *scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    *offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
  } else {
    *scale = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
    *offset = _mm512_loadu_ps(reinterpret_cast<const float*>(p) + 16);
  }
}

inline __mmask16 lanes_mask(const Packed& w, int64_t group) {
  const int64_t lanes = std::min<int64_t>(kLanes, w.n - group * kLanes);
  return static_cast<__mmask16>((1u << lanes) - 1);
}

// M = 1: one 16-row group, on x centered per block (c_k = x_k - mean_b, Step::x):
//   y = sum_b scale_b * (sum_k c_k q_k) + mean_b * (scale_b * sum_k q_k + block_size * offset_b),
// the second factor being the block's weight sum. The same as sum_b scale_b * (sum_k x_k q_k)
// + offset_b * blocksum_b, whose two terms cancel when x has a large common part (an input of
// mean 50 lost 1.8e-5 to 6.9e-5 relative that way, against ~4e-7 for float32 x @ w); centered,
// the error is float32 x @ w's. The code sums ride on the adders, beside the multiply-adds.
template <bool HALF>
void gemv_group(const Step& st, int64_t group) {
  const Packed& w = *st.w;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 block_size = _mm512_set1_ps(static_cast<float>(w.block_size));
  __m512 acc = _mm512_setzero_ps(), acc_means = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* p = w.block(group, b);
    const float* x = st.x + b * w.block_size;
    __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps(), t2 = _mm512_setzero_ps(), t3 = _mm512_setzero_ps();
    __m512 q0 = _mm512_setzero_ps(), q1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < w.block_size / 2; i += 2) {   // two k-pairs: four chains
      const __m512i c0 = load_codes(p + i * kLanes), c1 = load_codes(p + (i + 1) * kLanes);
      const __m512 e0 = codes_low(c0, table), o0 = codes_high(c0, table);
      const __m512 e1 = codes_low(c1, table), o1 = codes_high(c1, table);
      t0 = _mm512_fmadd_ps(e0, _mm512_set1_ps(x[2 * i]), t0);
      t1 = _mm512_fmadd_ps(o0, _mm512_set1_ps(x[2 * i + 1]), t1);
      t2 = _mm512_fmadd_ps(e1, _mm512_set1_ps(x[2 * i + 2]), t2);
      t3 = _mm512_fmadd_ps(o1, _mm512_set1_ps(x[2 * i + 3]), t3);
      q0 = _mm512_add_ps(q0, _mm512_add_ps(e0, o0));
      q1 = _mm512_add_ps(q1, _mm512_add_ps(e1, o1));
    }
    __m512 scale, offset;
    load_scale_offset<HALF>(p + w.code_bytes(), &scale, &offset);
    acc = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(t0, t1), _mm512_add_ps(t2, t3)), scale, acc);
    const __m512 weight_sum = _mm512_fmadd_ps(scale, _mm512_add_ps(q0, q1), _mm512_mul_ps(block_size, offset));
    acc_means = _mm512_fmadd_ps(weight_sum, _mm512_set1_ps(st.means[b]), acc_means);
  }
  _mm512_mask_storeu_ps(st.y + group * kLanes, lanes_mask(w, group), _mm512_add_ps(acc, acc_means));
}

// M > 1: ROWS rows of x from r0 x GROUPS (1 or 2) groups from `group`, on the dequantized
// weights (two groups: two multiply-adds per broadcast of x).
template <int ROWS, int GROUPS, bool HALF>
void gemm_tile(const Step& st, int64_t r0, int64_t group) {
  const Packed& w = *st.w;
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[ROWS][GROUPS];
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_setzero_ps();
  const float* x0 = st.x + r0 * st.ldx;
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* p[GROUPS];
    __m512 scale[GROUPS], offset[GROUPS];
    for (int g = 0; g < GROUPS; ++g) {
      p[g] = w.block(group + g, b);
      load_scale_offset<HALF>(p[g] + w.code_bytes(), &scale[g], &offset[g]);
    }
    const float* x = x0 + b * w.block_size;
    for (int64_t i = 0; i < w.block_size / 2; ++i) {
      __m512 w_even[GROUPS], w_odd[GROUPS];
      for (int g = 0; g < GROUPS; ++g) {
        const __m512i c = load_codes(p[g] + i * kLanes);
        w_even[g] = _mm512_fmadd_ps(codes_low(c, table), scale[g], offset[g]);
        w_odd[g] = _mm512_fmadd_ps(codes_high(c, table), scale[g], offset[g]);
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m512 x_even = _mm512_set1_ps(x[r * st.ldx + 2 * i]), x_odd = _mm512_set1_ps(x[r * st.ldx + 2 * i + 1]);
        for (int g = 0; g < GROUPS; ++g) {
          acc[r][g] = _mm512_fmadd_ps(w_even[g], x_even, acc[r][g]);
          acc[r][g] = _mm512_fmadd_ps(w_odd[g], x_odd, acc[r][g]);
        }
      }
    }
  }
  for (int g = 0; g < GROUPS; ++g) {
    const __mmask16 mask = lanes_mask(w, group + g);
    for (int r = 0; r < ROWS; ++r)
      _mm512_mask_storeu_ps(st.y + (r0 + r) * w.n + (group + g) * kLanes, mask, acc[r][g]);
  }
}

template <int GROUPS, bool HALF>
void gemm_rows(const Step& st, int64_t r0, int64_t rows, int64_t group) {
  for (; rows >= kTileRows; rows -= kTileRows, r0 += kTileRows) gemm_tile<kTileRows, GROUPS, HALF>(st, r0, group);
  switch (rows) {
    case 7: return gemm_tile<7, GROUPS, HALF>(st, r0, group);
    case 6: return gemm_tile<6, GROUPS, HALF>(st, r0, group);
    case 5: return gemm_tile<5, GROUPS, HALF>(st, r0, group);
    case 4: return gemm_tile<4, GROUPS, HALF>(st, r0, group);
    case 3: return gemm_tile<3, GROUPS, HALF>(st, r0, group);
    case 2: return gemm_tile<2, GROUPS, HALF>(st, r0, group);
    case 1: return gemm_tile<1, GROUPS, HALF>(st, r0, group);
    default: return;
  }
}

template <bool HALF>
void gemm_item(const Step& st, int64_t r0, int64_t rows, int64_t group) {
  if (group + 1 < st.w->groups) return gemm_rows<2, HALF>(st, r0, rows, group);
  return gemm_rows<1, HALF>(st, r0, rows, group);
}
#endif

// Portable loops (no AVX-512): the dequantized weight, one output at a time.
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
  return scale_at(w, p + kLanes * (w.half ? 2 : 4), lane);
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
        for (int64_t i = 0; i < w.block_size / 2; ++i) {
          const uint8_t c = p[i * kLanes + lane];
          total += x[2 * i] * std::fma(static_cast<float>(c & 15), scale, offset);
          total += x[2 * i + 1] * std::fma(static_cast<float>(c >> 4), scale, offset);
        }
      }
      st.y[r * w.n + group * kLanes + lane] = total;
    }
  }
}

// Work items: M = 1, one group each; M > 1, kRowsPerItem rows x a pair of groups each.
int64_t group_items(const Step& st) { return st.rows == 1 ? st.w->groups : (st.w->groups + 1) / 2; }

void run_item(void* user, size_t item) {
  const Step& st = *static_cast<const Step*>(user);
  const Packed& w = *st.w;
  const int64_t per_row_chunk = group_items(st);
  const int64_t r0 = static_cast<int64_t>(item) / per_row_chunk * kRowsPerItem;
  const int64_t rows = std::min(kRowsPerItem, st.rows - r0);
#ifdef __AVX512F__
  if (st.rows == 1) {
    const int64_t group = static_cast<int64_t>(item);
    return w.half ? gemv_group<true>(st, group) : gemv_group<false>(st, group);
  }
  const int64_t group = static_cast<int64_t>(item) % per_row_chunk * 2;
  return w.half ? gemm_item<true>(st, r0, rows, group) : gemm_item<false>(st, r0, rows, group);
#else
  const int64_t group = st.rows == 1 ? static_cast<int64_t>(item) : static_cast<int64_t>(item) % per_row_chunk * 2;
  for (int64_t g = group; g < std::min(w.groups, group + (st.rows == 1 ? 1 : 2)); ++g) portable_rows(st, r0, rows, g);
#endif
}

struct Kernel : KernelBase {
  bool with_offsets = false;
  int64_t n = 0, kernel_k = 0, block_size = 0;
  std::mutex mutex;
  std::array<const void*, 4> packed_from{};   // the weight inputs' data `packed` was made from
  size_t num_weights() const { return with_offsets ? 4 : 3; }
  std::string description() const {   // for errors: the op and its attributes
    return std::string(with_offsets ? "QuantizedLinearWithOffsets" : "QuantizedLinear") + " (N " + std::to_string(n) +
           ", K " + std::to_string(kernel_k) + ", block_size " + std::to_string(block_size) + ")";
  }
  Packed packed;
  OrtStatus* compute(OrtKernelContext* context) override;
  OrtStatus* check_and_pack(OrtKernelContext* context);
  OrtStatus* pack(const uint8_t* qweight, const float* scales, const uint8_t* zero_points, const float* offsets,
                  int64_t nbo);
};

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
  w.data.assign(static_cast<size_t>(w.groups * w.nb * w.block_bytes()), 0);
  const int64_t pairs = block_size / 2;
  for (int64_t row = 0; row < n; ++row) {
    const int64_t group = row / kLanes, lane = row % kLanes;
    for (int64_t b = 0; b < w.nb; ++b) {
      uint8_t* p = const_cast<uint8_t*>(w.block(group, b));
      const uint8_t* codes = qweight + (row * w.nb + b) * pairs;
      for (int64_t i = 0; i < pairs; ++i) p[i * kLanes + lane] = codes[i];
      uint8_t* s = p + w.code_bytes();
      const float sv = scale[row * w.nb + b], ov = offset[row * w.nb + b];
      if (w.half) {
        uint16_t hs = 0, ho = 0;
        float_to_half_exact(sv, &hs);
        float_to_half_exact(ov, &ho);
        std::memcpy(s + 2 * lane, &hs, 2);
        std::memcpy(s + 2 * kLanes + 2 * lane, &ho, 2);
      } else {
        std::memcpy(s + 4 * lane, &sv, 4);
        std::memcpy(s + 4 * kLanes + 4 * lane, &ov, 4);
      }
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
  const uint8_t *q = nullptr, *z = nullptr;
  const float *s = nullptr, *o = nullptr;
  RETURN_IF_ERROR(data_of(qweight.value, &q));
  RETURN_IF_ERROR(data_of(scales.value, &s));
  RETURN_IF_ERROR(data_of(zero_points.value, &z));
  if (with_offsets) RETURN_IF_ERROR(data_of(offsets.value, &o));
  packed_from = {};   // until the repack succeeds
  RETURN_IF_ERROR(pack(q, s, z, o, nbo));
  packed_from = {q, s, z, o};
  return nullptr;
}

OrtStatus* Kernel::compute(OrtKernelContext* context) {
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  if (x.dims.size() != 2 || x.dims[1] != kernel_k)
    return error(ORT_INVALID_ARGUMENT, description() + ": x " + dims_string(x.dims) + " is not [M, K]");
  const float* x_data = nullptr;
  RETURN_IF_ERROR(data_of(x.value, &x_data));
  {
    // the weights are constants: their shapes are checked and the data repacked at the first
    // call, or when a weight input's data moves (later calls read only x's shape: shape
    // queries allocate)
    std::lock_guard<std::mutex> lock(mutex);
    bool same = true;
    for (size_t i = 0; i < num_weights(); ++i) {
      const OrtValue* value = nullptr;
      const void* data = nullptr;
      RETURN_IF_ERROR(input_value(context, i + 1, &value));
      RETURN_IF_ERROR(data_of(value, &data));
      same = same && data == packed_from[i];
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
  thread_local std::vector<float> x_buffer, means, centered;
  st.x = x_data;
  st.ldx = kernel_k;
  if (width != kernel_k) {
    x_buffer.assign(static_cast<size_t>(st.rows * width), 0.0f);
    for (int64_t r = 0; r < st.rows; ++r)
      std::memcpy(x_buffer.data() + r * width, x_data + r * kernel_k, sizeof(float) * kernel_k);
    st.x = x_buffer.data();
    st.ldx = width;
  }
#ifdef __AVX512F__
  if (st.rows == 1) {   // centered per block (gemv_group; the portable loops take x as it is)
    means.resize(static_cast<size_t>(nb));
    centered.resize(static_cast<size_t>(width));
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = st.x + b * block_size;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < block_size; ++i) total += xb[i];
      const float mean = total / static_cast<float>(block_size);
      means[b] = mean;
#pragma omp simd
      for (int64_t i = 0; i < block_size; ++i) centered[b * block_size + i] = xb[i] - mean;
    }
    st.means = means.data();
    st.x = centered.data();
  }
#endif
  const int64_t row_items = st.rows == 1 ? 1 : (st.rows + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t items = row_items * group_items(st);
  // one thread below ~64 KiB of weights at batch 1 (waking the pool costs more than it saves)
  const bool serial = st.rows * packed.groups * packed.nb * packed.block_bytes() < (64 << 10);
  // even items: one contiguous range of groups per core
  return parallel_for(context, run_item, static_cast<size_t>(items), &st, serial,
                      std::min(static_cast<size_t>(items), available_cores()));
}

template <bool WITH_OFFSETS>
OrtStatus* create_kernel(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<Kernel>(kernel, [info](Kernel& k) {
    k.with_offsets = WITH_OFFSETS;
    RETURN_IF_ERROR(int_attribute(info, "N", &k.n));
    RETURN_IF_ERROR(int_attribute(info, "K", &k.kernel_k));
    return int_attribute(info, "block_size", &k.block_size);
  });
}

}  // namespace

const OrtCustomOp* quantized_linear_op() {
  static const CustomOp op({"QuantizedLinear", kInputs, 4, 1, create_kernel<false>});
  return &op;
}

const OrtCustomOp* quantized_linear_with_offsets_op() {
  static const CustomOp op({"QuantizedLinearWithOffsets", kInputs, 6, 1, create_kernel<true>});
  return &op;
}

}  // namespace trtllm_lite_kernels
