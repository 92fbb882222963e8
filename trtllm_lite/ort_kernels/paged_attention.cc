// trtllm_lite::PagedAttention for ONNX Runtime's CPU execution provider: the whole op, one
// node per layer, read straight from the paged KV pool (no gathered copy, no padding to the
// step's longest sequence, no mask tensor). ONNX Runtime runs it in place of the op's ONNX
// function body (builder/paged_attention.py), which picks a branch by the step's shape with
// `If` nodes and needs ~130 metadata nodes a step; the graphs for sessions with this library
// (graph_variants.custom_kernels) leave the metadata out.
//
// Inputs (builder/paged_attention.py, INPUT_NAMES; T tokens of S sequences):
//   0 query           [T, H, D]        float32
//   1 key             [T, Hkv, D]      float32   the step's new K (rotary applied)
//   2 value           [T, Hkv, D]      float32   the step's new V
//   3 key_cache       [N, B, Hkv, D]   float32 or float16 (the engine's kv_cache_dtype): this layer's K pool
//   4 value_cache     [N, B, Hkv, D]   the same type as key_cache
//   5 slot_mapping    [T]              int64     token t's pool slot (block * B + offset): with
//                                                kv_write_in_op = 1 the op stores the step's K/V there
//                                                itself, else the runtime does (unused here)
//   6 block_tables    [S, M]           int64     logical -> physical block
//   7 context_lens    [S]              int64     tokens cached before this step
//   8 query_start_loc [S + 1]          int64     sequence s's tokens: [qsl[s], qsl[s + 1])
//   9-22 (optional) the function body's metadata: unused here
// Attributes: scale (float); kv_write_in_op (int, default 0): 1 writes key / value into the
// pools at slot_mapping before attending (vLLM's reshape_and_cache, in the op: the graphs for
// sessions with this library return no new_keys / new_values, so the runtime has nothing to
// store; float16 pools get the values rounded to nearest even, saturating at +-65504, as the
// runtime's store would). The pools are the runtime's own memory, bound to the session without
// a copy, so the write lands in them. Output: [T, H, D] float32. Query head h reads KV head h / (H / Hkv)
// (grouped-query attention); token j of sequence s attends its cached positions and the
// step's tokens of s up to j (causal).
//
// Decode steps (every sequence computes one token): for each sequence (or, with fewer
// sequences than twice the cores, each chunk of a sequence's context; one short sequence:
// each KV head, so every thread has work) the kernel walks the sequence's blocks through its
// block table twice (scores, then the weighted sum of values), fetching the next block into L2
// while it computes the current one (blocks lie anywhere in the pool, where the hardware
// prefetcher cannot follow).
//
// Other steps (prompts, prompt chunks, draft verification, mixed with decodes): the decodes
// as above (run_mixed_decodes), the rest in tiles of a sequence's tokens x one KV head's
// query heads, keys 64 at a time with an online softmax (attend_tile, below).
//
// Pools of float16 (KV, below: uint16_t holding IEEE binary16 bits) are converted to float32
// as they are loaded (F16C's vcvtph2ps where the CPU has it); all arithmetic is float32.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_common.h"

namespace trtllm_lite_kernels {
namespace {

// A pool element as float: float32 as is, float16 (its bits in a uint16_t) converted.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// x rounded to the nearest float16 (ties to even), as float: what a float16 pool will hold.
// Past float16's range it saturates at +-65504 (the runtime's store clips alike), never inf.
constexpr float kHalfMax = 65504.0f;
inline float round_to_half(float x) {
  x = std::min(std::max(x, -kHalfMax), kHalfMax);   // (NaN stays NaN)
#ifdef __F16C__
  return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t sign = bits & 0x80000000u, a = bits ^ sign;
  if (a >= 0x7f800000u) return x;                                  // NaN (inf was clamped above)
  if (a < 0x38800000u)                                             // below 2^-14: float16 subnormals
    return std::copysign(std::nearbyint(std::fabs(x) * 16777216.0f) / 16777216.0f, x);   // steps of 2^-24
  uint32_t r = a + 0x0fffu + ((a >> 13) & 1u);                     // 10 mantissa bits, ties to even
  r = (r & ~0x1fffu) | sign;
  float out;
  std::memcpy(&out, &r, 4);
  return out;
#endif
}

// round_to_half over n values, 8 at a time with F16C (the same clamp, NaN kept: min / max
// return their second operand when either is NaN).
inline void round_to_half_n(const float* in, size_t n, float* out) {
  size_t i = 0;
#ifdef __F16C__
  const __m256 hi = _mm256_set1_ps(kHalfMax), lo = _mm256_set1_ps(-kHalfMax);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(in + i)));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  }
#endif
  for (; i < n; ++i) out[i] = round_to_half(in[i]);
}

#ifdef TRTLLM_LITE_AVX2
inline __m256 load_ps8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_ps8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
#ifdef __AVX512F__
inline __m512 load_ps16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_ps16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

constexpr int64_t kMinSequencesPerItemSplit = 2;
constexpr int64_t kMinChunkBlocks = 4;   // context blocks per chunk at least (few sequences)

template <typename KV>   // the pools' element type: float, or uint16_t (float16 bits)
struct DecodeStep {
  const float *query, *key, *value;
  const KV *key_cache, *value_cache;
  const int64_t *block_tables, *context_lens;
  float* output;
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t heads_per_item;   // KV heads one work item takes: all of them, or 1 for one unchunked sequence
  // Few sequences (AVX-512 and AVX2 paths): each sequence's context in chunks of chunk_blocks blocks, a
  // work item per (sequence, chunk) over all KV heads; the items leave partial softmax results
  // (row max, sum of exponentials, unnormalized output) that merge_chunks combines
  // (flash-decoding's split-KV: Dao et al. 2023, "Flash-Decoding for long-context inference").
  int64_t chunks_per_seq = 1, chunk_blocks = 0;
  float* partial = nullptr;   // [S * chunks_per_seq, H, D + 2]: D sums, then max, sum
  float scale;
};

// The next block's lines, prefetched into L2 a share at a time by the loop that computes the
// current block (upto), so that the fetching overlaps the computing: a block's prefetches issued
// in one burst (a float32 block of SmolLM2 is 192 lines) stall the core until most of them are
// in flight, and then it computes with nothing in flight. Spread: decode attention over 64
// sequences of ~400 tokens, float32 pool, 2-core Zen 4 VM: 16.5 -> 26.3 GB/s of KV read (1.6x),
// float16 pool 13.6 -> 18.6 GB/s, one sequence of 1,000 tokens 14.7 -> 25.8 GB/s.
struct BlockPrefetch {
  const char* next = nullptr;   // the next block's first byte (null: no next block)
  int64_t bytes = 0, issued = 0;
  // prefetch the lines of the first num / den of the block not yet asked for
  inline void upto(int64_t num, int64_t den) {
    const int64_t to = bytes * num / den;
    for (; issued < to; issued += 64) __builtin_prefetch(next + issued, 0, 2);   // prefetcht1
  }
};

// The pool rows of sequence s from KV head h on, block by block, for cached positions
// [begin, end) (begin a multiple of the block size): fn(row pointer, first position, rows) for
// each block, or fn(row pointer, first position, rows, BlockPrefetch& next) where fn spreads
// the next block's prefetches over its work (the rest are issued after it). The blocks are
// prefetched into L2 (prefetcht1): a core keeps more lines in flight to L2 than to L1, whose miss
// buffers a block's lines filled with prefetcht0 (SmolLM2 int4 batch 1 at ~384 tokens of
// context on a 2-core Zen 4 VM: a decode step 6.0 -> 5.6 ms, attention ~1.5 -> ~1.1 ms of it;
// two or three blocks ahead: no better). A three-argument fn gets the next block's prefetches
// in one burst before it runs. `then`: the pool the pass after this one starts on (the values
// after the keys), whose block at `begin` is this pass's last block's next, so that the next
// pass does not start on a cold block; that pass is called with `first_fetched` and does not
// ask for it again (decode steps interleaved, 2-core Zen 4 VM: SmolLM2 int4 batch 1 1.004-1.009x
// at ~160 tokens of context, 1.026x at ~540; 8 sequences 1.009x; fp32, 64 sequences 1.005x).
// (Step: DecodeStep or PrefillStep, below: their block table and pool sizes.)
template <typename Step, typename KV, typename Fn>
inline void for_each_block(const Step& st, int64_t s, int64_t h, const KV* pool, int64_t begin,
                           int64_t end, Fn fn, const std::common_type_t<KV>* then = nullptr,
                           bool first_fetched = false) {   // (then: KV deduced from pool alone)
  const int64_t bs = st.block_size, hkv = st.num_kv_heads, d = st.head_dim;
  const int64_t* table = st.block_tables + s * st.max_blocks;
  const int64_t block_floats = bs * hkv * d;   // elements (float or float16) a block holds
  const int64_t bytes = block_floats * static_cast<int64_t>(sizeof(KV));
  auto block_at = [&](const KV* p, int64_t block_index) {   // a block's prefetch (blocks lie anywhere in the pool)
    return BlockPrefetch{reinterpret_cast<const char*>(p + table[block_index] * block_floats), bytes};
  };
  auto after = [&](int64_t start) {   // the block after the one at `start`: this pool's next, or then's first
    return start + bs < end ? block_at(pool, start / bs + 1) : then ? block_at(then, begin / bs) : BlockPrefetch{};
  };
  if (begin < end && !first_fetched) block_at(pool, begin / bs).upto(1, 1);   // all its lines at once
  for (int64_t start = begin; start < end; start += bs) {
    const KV* rows = pool + table[start / bs] * block_floats + h * d;
    const int64_t len = std::min(bs, end - start);
    BlockPrefetch next = after(start);
    if constexpr (std::is_invocable_v<Fn, const KV*, int64_t, int64_t, BlockPrefetch&>) {
      fn(rows, start, len, next);
      next.upto(1, 1);
    } else {
      next.upto(1, 1);
      fn(rows, start, len);
    }
  }
}

// Portable version: any head_dim. scores [G, n] (n = ctx + 1), acc [G, D] scratch.
template <typename KV>
void attend_portable(const DecodeStep<KV>& st, int64_t s, int64_t h, float* scores, float* acc) {
  const int64_t hkv = st.num_kv_heads, d = st.head_dim, group = st.num_heads / hkv;
  const int64_t ctx = st.context_lens[s], n = ctx + 1, stride = hkv * d;
  const float* q = st.query + (s * st.num_heads + h * group) * d;   // [G, D]
  auto score_row = [&](const auto* k, int64_t pos) {   // k: a pool row (KV) or the new key (float)
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qg[i] * to_float(k[i]);
      scores[g * n + pos] = dot * st.scale;
    }
  };
  for_each_block(st, s, h, st.key_cache, 0, ctx, [&](const KV* k, int64_t first, int64_t rows) {
    for (int64_t j = 0; j < rows; ++j) score_row(k + j * stride, first + j);
  }, st.value_cache);
  score_row(st.key + (s * hkv + h) * d, ctx);
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * n;
    float m = row[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, row[i]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      row[i] = exp_nonpositive(row[i] - m);
      total += row[i];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] *= inv;
  }
  std::fill(acc, acc + group * d, 0.0f);
  auto add_row = [&](const auto* v, int64_t pos) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + pos];
      float* a = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += p * to_float(v[i]);
    }
  };
  for_each_block(st, s, h, st.value_cache, 0, ctx, [&](const KV* v, int64_t first, int64_t rows) {
    for (int64_t j = 0; j < rows; ++j) add_row(v + j * stride, first + j);
  }, nullptr, true);
  add_row(st.value + (s * hkv + h) * d, ctx);
  std::memcpy(st.output + (s * st.num_heads + h * group) * d, acc, sizeof(float) * group * d);
}

// A chunk's partial results for merge_chunks, [rows, D + 2] per query head: the unnormalized
// output, the row max, the sum of exponentials; an empty chunk (a shorter sequence's) as
// max -inf and sum 0, which the merge skips.
[[maybe_unused]] void write_partial(float* partial, const float* acc, const float* maxes, const float* sums,
                                    int64_t rows, int64_t d) {
  for (int64_t g = 0; g < rows; ++g) {
    std::memcpy(partial + g * (d + 2), acc + g * d, sizeof(float) * d);
    partial[g * (d + 2) + d] = maxes[g];
    partial[g * (d + 2) + d + 1] = sums[g];
  }
}

[[maybe_unused]] void write_empty_partial(float* partial, int64_t rows, int64_t d) {
  for (int64_t g = 0; g < rows; ++g) {
    std::fill(partial + g * (d + 2), partial + g * (d + 2) + d, 0.0f);
    partial[g * (d + 2) + d] = -INFINITY;
    partial[g * (d + 2) + d + 1] = 0.0f;
  }
}

#ifdef __AVX512F__
// v[0..15] -> one vector whose lane i is the sum of v[i]'s lanes: a transpose-add in four
// steps (pairs within 128-bit lanes, then quads, then across the 128-bit lanes), 45 shuffles
// and adds for 16 sums where 16 horizontal sums take ~128. The first two steps take each four
// of the v on their own (sum16_quad), so a caller can run them as its vectors come.
// v[0..3] -> per 128-bit lane: that lane's sums of v[0], ..., v[3] (sum16's first two steps).
inline __m512 sum16_quad(const __m512 v[4]) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[0], v[1], then of v[2], v[3]
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// sum16's last two steps, on sum16_quad of v[0..3], v[4..7], v[8..11], v[12..15].
inline __m512 sum16_finish(const __m512 u[4]) {
  __m512 w[2];
  for (int k = 0; k < 2; ++k)   // 128-bit lanes [u0 + u1, u2 + u3] of u[2k], then of u[2k + 1]
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

inline __m512 sum16(const __m512 v[16]) {
  const __m512 u[4] = {sum16_quad(v), sum16_quad(v + 4), sum16_quad(v + 8), sum16_quad(v + 12)};
  return sum16_finish(u);
}

// AVX-512 version for head_dim = 16 * NC: KV heads [h0, h0 + nh) of sequence s, each pool row
// read from memory once for all of them (one contiguous nh * D stretch), then from L1 for each
// of a KV head's query heads (a block's scores 16 positions at a time, its values summed in
// registers).
// Cached positions [begin, end), plus the new token when with_new (the last chunk). partial:
// null to write the normalized output, else [rows, D + 2] for merge_chunks (all KV heads).
// G: the query heads per KV head when the caller knows it (attend_avx512_any), else 0. With G,
// each K and V row is loaded (a float16 one converted) once for its G query heads, where the
// general loops below load it once per query head; the arithmetic is the same, operation by
// operation, so the outputs are bit for bit the general loops'.
template <int NC, int G, typename KV>
void attend_avx512(const DecodeStep<KV>& st, int64_t s, int64_t h0, int64_t nh, int64_t begin, int64_t end,
                   bool with_new, float* scores, float* acc, float* partial) {
  constexpr int64_t d = 16 * NC;
  const int64_t hkv = st.num_kv_heads, group = G > 0 ? G : st.num_heads / hkv, rows = nh * group;
  const int64_t ctx = st.context_lens[s], stride = hkv * d;
  const int64_t n = end - begin + (with_new ? 1 : 0);
  if (n == 0) return write_empty_partial(partial, rows, d);   // a shorter sequence's chunk
  const float* q = st.query + (s * st.num_heads + h0 * group) * d;   // [rows, D]
  float* q_scaled = acc;                        // [rows, D] scratch, reused for the sums below
  for (int64_t i = 0; i < rows * d; ++i) q_scaled[i] = q[i] * st.scale;

  // scores of up to 16 positions at a time: 16 dot-product vectors, then one transpose-add
  // (sum16) into a vector of 16 scores, instead of a horizontal sum per position
  // (next: the next block, prefetched a share per query head and tile)
  auto score_rows = [&](const auto* k, int64_t first, int64_t len, BlockPrefetch& next) {   // k: head h0's row at first
    if constexpr (G > 0) {
      // per KV head and 4 positions: each row's NC vectors loaded once, times the G heads' q
      // (G x 4 dot products in registers), then sum16's first steps on each head's four
      const int64_t shares = (len + 15) / 16 * nh * 4;
      for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t tile = std::min<int64_t>(16, len - j0);
        const __mmask16 mask = static_cast<__mmask16>((1u << tile) - 1);
        for (int64_t hh = 0; hh < nh; ++hh) {
          const auto* kh = k + j0 * stride + hh * d;
          __m512 qv[G][NC], quads[G][4];
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < NC; ++c) qv[g][c] = _mm512_loadu_ps(q_scaled + (hh * G + g) * d + 16 * c);
          for (int jq = 0; jq < 4; ++jq) {
            next.upto(((j0 / 16) * nh + hh) * 4 + jq + 1, shares);
            __m512 dots[G][4];
            for (int jj = 0; jj < 4; ++jj) {
              const int64_t j = 4 * jq + jj;
              if (j >= tile) {
                for (int g = 0; g < G; ++g) dots[g][jj] = _mm512_setzero_ps();
                continue;
              }
              const auto* kr = kh + j * stride;
              const __m512 k0 = load_ps16(kr);
              for (int g = 0; g < G; ++g) dots[g][jj] = _mm512_mul_ps(qv[g][0], k0);
              for (int c = 1; c < NC; ++c) {
                const __m512 kc = load_ps16(kr + 16 * c);
                for (int g = 0; g < G; ++g) dots[g][jj] = _mm512_fmadd_ps(qv[g][c], kc, dots[g][jj]);
              }
            }
            for (int g = 0; g < G; ++g) quads[g][jq] = sum16_quad(dots[g]);
          }
          for (int g = 0; g < G; ++g)
            _mm512_mask_storeu_ps(scores + (hh * G + g) * n + first + j0 - begin, mask, sum16_finish(quads[g]));
        }
      }
      return;
    }
    const int64_t shares = (len + 15) / 16 * rows;
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const int64_t tile = std::min<int64_t>(16, len - j0);
      const __mmask16 mask = static_cast<__mmask16>((1u << tile) - 1);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const auto* kh = k + j0 * stride + hh * d;
        for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
          next.upto(j0 / 16 * rows + g + 1, shares);
          __m512 qv[NC], dots[16];
          for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q_scaled + g * d + 16 * c);
          for (int64_t j = 0; j < 16; ++j) {
            if (j >= tile) {
              dots[j] = _mm512_setzero_ps();
              continue;
            }
            const auto* kr = kh + j * stride;
            __m512 dot = _mm512_mul_ps(qv[0], load_ps16(kr));
            for (int c = 1; c < NC; ++c) dot = _mm512_fmadd_ps(qv[c], load_ps16(kr + 16 * c), dot);
            dots[j] = dot;
          }
          _mm512_mask_storeu_ps(scores + g * n + first + j0 - begin, mask, sum16(dots));
        }
      }
    }
  };
  BlockPrefetch no_next;
  for_each_block(st, s, h0, st.key_cache, begin, end, score_rows, st.value_cache);
  if (with_new) score_rows(st.key + (s * hkv + h0) * d, ctx, 1, no_next);

  thread_local std::vector<float> inv_total, maxes;
  inv_total.resize(static_cast<size_t>(rows));
  maxes.resize(static_cast<size_t>(rows));
  for (int64_t g = 0; g < rows; ++g) {          // exponentials in place, their sum kept
    float* row = scores + g * n;
    __m512 m = _mm512_set1_ps(-3.0e38f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + i));
    float mx = _mm512_reduce_max_ps(m);
    for (; i < n; ++i) mx = std::max(mx, row[i]);
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 total = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + i), mv));
      _mm512_storeu_ps(row + i, e);
      total = _mm512_add_ps(total, e);
    }
    if (i < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + i), mv));
      _mm512_mask_storeu_ps(row + i, tail, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
    }
    maxes[g] = mx;
    inv_total[g] = _mm512_reduce_add_ps(total);   // the sum; inverted below for the output
  }

  std::fill(acc, acc + rows * d, 0.0f);
  // per query head, a block's rows into accumulators held in registers (two sets, even and
  // odd positions, so the multiply-adds do not wait on each other); the rows come from L1
  // after the group's first head
  auto add_rows = [&](const auto* v, int64_t first, int64_t len, BlockPrefetch& next) {
    if constexpr (G > 0) {
      // per KV head: the even positions into the G heads' sums (from acc), then the odd ones
      // (from 0), each row loaded once for the G heads; acc = even + odd, as below
      for (int64_t hh = 0; hh < nh; ++hh) {
        const auto* vh = v + hh * d;
        float* a = acc + hh * G * d;   // the G heads' sums, [G, D]
        const float* p = scores + hh * G * n + first - begin;   // head g's: p + g * n
        for (int parity = 0; parity < 2; ++parity) {
          next.upto(2 * hh + parity + 1, 2 * nh);
          __m512 sums[G][NC];
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < NC; ++c) sums[g][c] = parity ? _mm512_setzero_ps() : _mm512_loadu_ps(a + g * d + 16 * c);
          for (int64_t j = parity; j < len; j += 2) {
            __m512 row[NC];
            for (int c = 0; c < NC; ++c) row[c] = load_ps16(vh + j * stride + 16 * c);
            for (int g = 0; g < G; ++g) {
              const __m512 pg = _mm512_set1_ps(p[g * n + j]);
              for (int c = 0; c < NC; ++c) sums[g][c] = _mm512_fmadd_ps(pg, row[c], sums[g][c]);
            }
          }
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < NC; ++c) {
              float* out = a + g * d + 16 * c;
              _mm512_storeu_ps(out, parity ? _mm512_add_ps(_mm512_loadu_ps(out), sums[g][c]) : sums[g][c]);
            }
        }
      }
      return;
    }
    for (int64_t hh = 0; hh < nh; ++hh) {
      const auto* vh = v + hh * d;
      for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
        next.upto(g + 1, rows);   // a share of the next block per query head
        const float* p = scores + g * n + first - begin;
        float* a = acc + g * d;
        __m512 even[NC], odd[NC];
        for (int c = 0; c < NC; ++c) {
          even[c] = _mm512_loadu_ps(a + 16 * c);
          odd[c] = _mm512_setzero_ps();
        }
        int64_t j = 0;
        for (; j + 2 <= len; j += 2) {
          const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
          const auto *v0 = vh + j * stride, *v1 = v0 + stride;
          for (int c = 0; c < NC; ++c) {
            even[c] = _mm512_fmadd_ps(p0, load_ps16(v0 + 16 * c), even[c]);
            odd[c] = _mm512_fmadd_ps(p1, load_ps16(v1 + 16 * c), odd[c]);
          }
        }
        if (j < len) {
          const __m512 p0 = _mm512_set1_ps(p[j]);
          for (int c = 0; c < NC; ++c) even[c] = _mm512_fmadd_ps(p0, load_ps16(vh + j * stride + 16 * c), even[c]);
        }
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_add_ps(even[c], odd[c]));
      }
    }
  };
  for_each_block(st, s, h0, st.value_cache, begin, end, add_rows, nullptr, true);
  if (with_new) add_rows(st.value + (s * hkv + h0) * d, ctx, 1, no_next);
  if (partial) return write_partial(partial, acc, maxes.data(), inv_total.data(), rows, d);
  float* out = st.output + (s * st.num_heads + h0 * group) * d;
  for (int64_t g = 0; g < rows; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / inv_total[g]);
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(out + g * d + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + 16 * c), inv));
  }
}

// attend_avx512 with G for the common group sizes whose G x NC sums fit the registers
// (SmolLM2: 3 query heads per KV head, head_dim 64), else the general loops.
template <int NC, typename KV>
void attend_avx512_any(const DecodeStep<KV>& st, int64_t s, int64_t h0, int64_t nh, int64_t begin, int64_t end,
                       bool with_new, float* scores, float* acc, float* partial) {
  const int64_t group = st.num_heads / st.num_kv_heads;
  if constexpr (NC <= 4) {
    if (group == 2) return attend_avx512<NC, 2, KV>(st, s, h0, nh, begin, end, with_new, scores, acc, partial);
    if (group == 3) return attend_avx512<NC, 3, KV>(st, s, h0, nh, begin, end, with_new, scores, acc, partial);
  }
  if constexpr (NC <= 2) {
    if (group == 4) return attend_avx512<NC, 4, KV>(st, s, h0, nh, begin, end, with_new, scores, acc, partial);
  }
  return attend_avx512<NC, 0, KV>(st, s, h0, nh, begin, end, with_new, scores, acc, partial);
}
#endif

#ifdef TRTLLM_LITE_AVX2
// v[0..7] -> one vector whose lane i is the sum of v[i]'s lanes (sum16's transpose-add, 8 lanes).
inline __m256 sum8(const __m256 v[8]) {
  __m256 t[4], u[2];
  for (int k = 0; k < 4; ++k)   // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[k] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 2; ++k)   // per 128-bit lane: that lane's sums of v[4k .. 4k + 3]
    u[k] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

// AVX2 version of attend_avx512 (same work items, chunks and partial results), head_dim =
// 8 * NC, 8 positions' scores at a time; one accumulator set for the values where NC >= 4
// (NC chains already; two sets would not fit the 16 registers).
template <int NC, typename KV>
void attend_avx2(const DecodeStep<KV>& st, int64_t s, int64_t h0, int64_t nh, int64_t begin, int64_t end,
                 bool with_new, float* scores, float* acc, float* partial) {
  constexpr int64_t d = 8 * NC;
  const int64_t hkv = st.num_kv_heads, group = st.num_heads / hkv, rows = nh * group;
  const int64_t ctx = st.context_lens[s], stride = hkv * d;
  const int64_t n = end - begin + (with_new ? 1 : 0);
  if (n == 0) return write_empty_partial(partial, rows, d);   // a shorter sequence's chunk
  const float* q = st.query + (s * st.num_heads + h0 * group) * d;   // [rows, D]
  float* q_scaled = acc;                        // [rows, D] scratch, reused for the sums below
  for (int64_t i = 0; i < rows * d; ++i) q_scaled[i] = q[i] * st.scale;

  // (next: the next block, prefetched a share per query head and tile)
  auto score_rows = [&](const auto* k, int64_t first, int64_t len, BlockPrefetch& next) {   // k: head h0's row at first
    const int64_t shares = (len + 7) / 8 * rows;
    for (int64_t j0 = 0; j0 < len; j0 += 8) {
      const int64_t tile = std::min<int64_t>(8, len - j0);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const auto* kh = k + j0 * stride + hh * d;
        for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
          next.upto(j0 / 8 * rows + g + 1, shares);
          const float* qg = q_scaled + g * d;
          __m256 dots[8];
          for (int64_t j = 0; j < 8; ++j) {
            if (j >= tile) {
              dots[j] = _mm256_setzero_ps();
              continue;
            }
            const auto* kr = kh + j * stride;
            __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(qg), load_ps8(kr));
            for (int c = 1; c < NC; ++c) dot = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), load_ps8(kr + 8 * c), dot);
            dots[j] = dot;
          }
          float* out_scores = scores + g * n + first + j0 - begin;
          if (tile == 8) {   // (a memcpy of a variable length here was ~12% of the kernel)
            _mm256_storeu_ps(out_scores, sum8(dots));
          } else {
            alignas(32) float tile_scores[8];
            _mm256_store_ps(tile_scores, sum8(dots));
            for (int64_t j = 0; j < tile; ++j) out_scores[j] = tile_scores[j];
          }
        }
      }
    }
  };
  BlockPrefetch no_next;
  for_each_block(st, s, h0, st.key_cache, begin, end, score_rows, st.value_cache);
  if (with_new) score_rows(st.key + (s * hkv + h0) * d, ctx, 1, no_next);

  thread_local std::vector<float> inv_total, maxes;
  inv_total.resize(static_cast<size_t>(rows));
  maxes.resize(static_cast<size_t>(rows));
  for (int64_t g = 0; g < rows; ++g) {          // exponentials in place, their sum kept
    float* row = scores + g * n;
    __m256 m8 = _mm256_set1_ps(row[0]);   // the row's max, 8 lanes at a time
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(row + k));
    alignas(32) float max_lanes[8];
    _mm256_store_ps(max_lanes, m8);
    float mx = *std::max_element(max_lanes, max_lanes + 8);
    for (; k < n; ++k) mx = std::max(mx, row[k]);
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 total = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(row + i), mv));
      _mm256_storeu_ps(row + i, e);
      total = _mm256_add_ps(total, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, total);
    float sum = 0.0f;
    for (int l = 0; l < 8; ++l) sum += lanes[l];
    for (; i < n; ++i) {
      row[i] = exp_nonpositive(row[i] - mx);
      sum += row[i];
    }
    maxes[g] = mx;
    inv_total[g] = sum;   // the sum; inverted below for the output
  }

  std::fill(acc, acc + rows * d, 0.0f);
  constexpr int kSets = NC >= 4 ? 1 : 2;   // accumulator sets (positions j % kSets)
  auto add_rows = [&](const auto* v, int64_t first, int64_t len, BlockPrefetch& next) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      const auto* vh = v + hh * d;
      for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
        next.upto(g + 1, rows);   // a share of the next block per query head
        const float* p = scores + g * n + first - begin;
        float* a = acc + g * d;
        __m256 sums[kSets][NC];
        for (int c = 0; c < NC; ++c) {
          sums[0][c] = _mm256_loadu_ps(a + 8 * c);
          if (kSets == 2) sums[kSets - 1][c] = _mm256_setzero_ps();
        }
        int64_t j = 0;
        for (; j + kSets <= len; j += kSets)
          for (int e = 0; e < kSets; ++e) {
            const __m256 pj = _mm256_set1_ps(p[j + e]);
            const auto* vj = vh + (j + e) * stride;
            for (int c = 0; c < NC; ++c) sums[e][c] = _mm256_fmadd_ps(pj, load_ps8(vj + 8 * c), sums[e][c]);
          }
        for (; j < len; ++j) {
          const __m256 pj = _mm256_set1_ps(p[j]);
          for (int c = 0; c < NC; ++c) sums[0][c] = _mm256_fmadd_ps(pj, load_ps8(vh + j * stride + 8 * c), sums[0][c]);
        }
        for (int c = 0; c < NC; ++c)
          _mm256_storeu_ps(a + 8 * c, kSets == 2 ? _mm256_add_ps(sums[0][c], sums[kSets - 1][c]) : sums[0][c]);
      }
    }
  };
  for_each_block(st, s, h0, st.value_cache, begin, end, add_rows, nullptr, true);
  if (with_new) add_rows(st.value + (s * hkv + h0) * d, ctx, 1, no_next);
  if (partial) return write_partial(partial, acc, maxes.data(), inv_total.data(), rows, d);
  float* out = st.output + (s * st.num_heads + h0 * group) * d;
  for (int64_t g = 0; g < rows; ++g) {
    const __m256 inv = _mm256_set1_ps(1.0f / inv_total[g]);
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_ps(out + g * d + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + g * d + 8 * c), inv));
  }
}
#endif

// One work item: KV heads [h0, h0 + heads_per_item) of one sequence (all their query heads);
// with chunks, one chunk of one sequence's context, all KV heads.
template <typename KV>
void attend(void* user, size_t item) {
  const DecodeStep<KV>& st = *static_cast<const DecodeStep<KV>*>(user);
  const int64_t hkv = st.num_kv_heads, group = st.num_heads / hkv, nh = st.heads_per_item;
  thread_local std::vector<float> buffer;
#if defined(__AVX512F__) || defined(TRTLLM_LITE_AVX2)
  if (st.chunks_per_seq > 1) {
    const int64_t s = static_cast<int64_t>(item) / st.chunks_per_seq, c = static_cast<int64_t>(item) % st.chunks_per_seq;
    const int64_t ctx = st.context_lens[s], span = st.chunk_blocks * st.block_size;
    const bool last = c == st.chunks_per_seq - 1;   // the new token's chunk
    const int64_t begin = std::min(ctx, c * span);
    const int64_t end = last ? ctx : std::min(ctx, begin + span);
    buffer.resize(static_cast<size_t>(st.num_heads * (end - begin + 1 + st.head_dim)));
    float* scores = buffer.data();
    float* acc = scores + st.num_heads * (end - begin + 1);
    float* partial = st.partial + static_cast<int64_t>(item) * st.num_heads * (st.head_dim + 2);
    switch (st.head_dim) {
#ifdef __AVX512F__
      case 16: return attend_avx512_any<1, KV>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 32: return attend_avx512_any<2, KV>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 64: return attend_avx512_any<4, KV>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 128: return attend_avx512_any<8, KV>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
#else
      case 16: return attend_avx2<2, KV>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 32: return attend_avx2<4, KV>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 64: return attend_avx2<8, KV>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 128: return attend_avx2<16, KV>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
#endif
      default: return;   // chunks are only planned for these head sizes
    }
  }
#endif
  const int64_t items_per_seq = hkv / nh;
  const int64_t s = static_cast<int64_t>(item) / items_per_seq, h0 = static_cast<int64_t>(item) % items_per_seq * nh;
  const int64_t ctx = st.context_lens[s], n = ctx + 1;
  buffer.resize(static_cast<size_t>(nh * group * (n + st.head_dim)));
  float* scores = buffer.data();              // [nh * G, n]
  float* acc = scores + nh * group * n;       // [nh * G, D]
#ifdef __AVX512F__
  switch (st.head_dim) {
    case 16: return attend_avx512_any<1, KV>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 32: return attend_avx512_any<2, KV>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 64: return attend_avx512_any<4, KV>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 128: return attend_avx512_any<8, KV>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    default: break;
  }
#elif defined(TRTLLM_LITE_AVX2)
  switch (st.head_dim) {
    case 16: return attend_avx2<2, KV>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 32: return attend_avx2<4, KV>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 64: return attend_avx2<8, KV>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 128: return attend_avx2<16, KV>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    default: break;
  }
#endif
  for (int64_t h = h0; h < h0 + nh; ++h) attend_portable(st, s, h, scores, acc);
}

// The chunks' partial results -> the output: per query head, the maxima's max M, then
// sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
template <typename KV>
[[maybe_unused]] void merge_chunks(const DecodeStep<KV>& st, int64_t num_seqs) {
  const int64_t d = st.head_dim, h_total = st.num_heads, c_total = st.chunks_per_seq;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t g = 0; g < h_total; ++g) {
      const float* part = st.partial + (s * c_total * h_total + g) * (d + 2);
      const int64_t chunk_stride = h_total * (d + 2);
      float m = -INFINITY;
      for (int64_t c = 0; c < c_total; ++c) m = std::max(m, part[c * chunk_stride + d]);
      float* out = st.output + (s * h_total + g) * d;
      std::fill(out, out + d, 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < c_total; ++c) {
        const float* p = part + c * chunk_stride;
        if (p[d + 1] == 0.0f) continue;   // an empty chunk
        const float w = std::exp(p[d] - m);
        total += w * p[d + 1];
        for (int64_t i = 0; i < d; ++i) out[i] += w * p[i];
      }
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < d; ++i) out[i] *= inv;
    }
}

// -- steps with a sequence computing several tokens (prefill, chunked prefill, draft verification) --

// A tile of up to `tile` consecutive query tokens of one sequence, one KV head, all its query
// heads: rows (token j, query head g), each attending the sequence's cached positions (read
// through the block table) and the step's own tokens up to j (causal), key chunk by key chunk
// with an online softmax (running max and sum, the output rescaled when the max grows: Milakov
// & Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al. 2022,
// FlashAttention), so no score row as long as the context is ever stored.
template <typename KV>
struct PrefillStep {
  const float *query, *key, *value;
  const KV *key_cache, *value_cache;
  const int64_t *block_tables, *context_lens, *query_start_loc;
  float* output;
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, tile;
  const int64_t* items;   // [num_items, 3]: sequence, KV head, first token of the tile (contiguous)
  float scale;
};

// Keys go through a tile kChunkKeys at a time, as up to kSegments segments of up to 16 keys
// whose rows are `stride` floats apart (a cached block's rows, or the step's own tokens).
constexpr int64_t kSegmentKeys = 16, kSegments = 4, kChunkKeys = kSegmentKeys * kSegments;

template <typename T>   // a chunk of pool rows (T: the pools' KV type) or of the step's own tokens (float)
struct KeyChunk {
  const T* keys[kSegments];
  const T* values[kSegments];
  int64_t count = 0;          // keys in the chunk: segments before the last are full
  int64_t causal_first = -1;  // the step-token index of the first key (a row of token j takes keys
                              // up to j), or -1 for cached positions (every row takes them all)
  const T* key(int64_t i, int64_t stride) const { return keys[i / kSegmentKeys] + i % kSegmentKeys * stride; }
  const T* value(int64_t i, int64_t stride) const {
    return values[i / kSegmentKeys] + i % kSegmentKeys * stride;
  }
};

// The tile's running state: rows (token j0 + r / group, query head r % group).
struct TileState {
  const float* q;   // [rows, D]: the queries times scale
  float* acc;       // [rows, D]: unnormalized outputs
  float* maxes;     // [rows]: the running max (-3e38 before the first key)
  float* sums;      // [rows]: the running sum of exponentials
  float* scores;    // [rows, kChunkKeys]
  float* kt;        // [D, kChunkKeys]: the chunk's keys transposed (vector path)
  int64_t rows, group, j0, d, stride;
  template <typename T>
  int64_t limit(const KeyChunk<T>& c, int64_t r) const {   // keys row r takes from chunk c
    return c.causal_first < 0 ? c.count : std::min(c.count, j0 + r / group - c.causal_first + 1);
  }
};

// The online-softmax update of row r with its chunk scores row[0, limit): new max, the old sums
// and outputs rescaled by e^(old max - new max), the scores turned into exponentials in place.
// Returns the rescale factor.
inline float softmax_update(const TileState& t, int64_t r, float* row, int64_t limit) {
  float mx = t.maxes[r];
  for (int64_t i = 0; i < limit; ++i) mx = std::max(mx, row[i]);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < limit; ++i) {
    row[i] = exp_nonpositive(row[i] - mx);
    total += row[i];
  }
  const float alpha = exp_nonpositive(t.maxes[r] - mx);   // ~0 at the first chunk
  t.sums[r] = t.sums[r] * alpha + total;
  t.maxes[r] = mx;
  return alpha;
}

// Any head_dim: per row, dot products, then the values.
template <typename T>
inline void attend_chunk(const TileState& t, const KeyChunk<T>& c) {
  const int64_t d = t.d;
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t limit = t.limit(c, r);
    if (limit <= 0) continue;
    const float* qr = t.q + r * d;
    float* row = t.scores + r * kChunkKeys;
    for (int64_t i = 0; i < limit; ++i) {
      const T* ki = c.key(i, t.stride);
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t x = 0; x < d; ++x) dot += qr[x] * to_float(ki[x]);
      row[i] = dot;
    }
    const float alpha = softmax_update(t, r, row, limit);
    float* a = t.acc + r * d;
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) a[x] *= alpha;
    for (int64_t i = 0; i < limit; ++i) {
      const float p = row[i];
      const T* vi = c.value(i, t.stride);
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) a[x] += p * to_float(vi[x]);
    }
  }
}

// head_dim D = 8 * NC (16 to 128), in 8-float vectors (GCC's vector extensions: AVX2 and
// AVX-512 builds alike, SSE pairs on the portable one). The chunk's keys are transposed once
// to [D][64], so 4 rows' scores for 16 keys are 8 independent chains of D multiply-adds with no
// horizontal sums; then per row the softmax update and its output, in registers, plus the
// chunk's values.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// 8 float16 values (bits) as floats
inline v8f load8(const uint16_t* p) {
#ifdef __F16C__
  return (v8f)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return v8f{half_to_float(p[0]), half_to_float(p[1]), half_to_float(p[2]), half_to_float(p[3]),
             half_to_float(p[4]), half_to_float(p[5]), half_to_float(p[6]), half_to_float(p[7])};
#endif
}
inline void store8(float* p, const v8f& v) { std::memcpy(p, &v, sizeof v); }
inline v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// exp_nonpositive on 8 lanes (its reduction and polynomial; n by the 1.5 * 2^23 rounding trick).
inline v8f exp_nonpositive_v8(const v8f& x_in) {
  const v8f x = x_in < -87.0f ? splat8(-87.0f) : x_in;
  const v8f t = x * 1.44269504088896341f + 12582912.0f;   // n + 1.5 * 2^23: n in the low bits
  const v8f n = t - 12582912.0f;
  const v8f r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  const v8i bits = ((v8i)t - 0x4B400000 + 127) << 23;   // (vector casts keep the bits)
  return exp_reduced(r) * (v8f)bits;
}

// softmax_update in 8-lane groups (lanes past limit: no part in the max, exponentials 0).
inline float softmax_update_v8(const TileState& t, int64_t r, float* row, int64_t limit) {
  const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t groups = (limit + 7) / 8;
  v8f m = splat8(t.maxes[r]);
  for (int64_t g = 0; g < groups; ++g) {
    const v8f x = load8(row + 8 * g);
    m = (lane + static_cast<int32_t>(8 * g) < static_cast<int32_t>(limit)) & (x > m) ? x : m;
  }
  float mx = m[0];
  for (int i = 1; i < 8; ++i) mx = std::max(mx, m[i]);
  const v8f mv = splat8(mx);
  v8f total = {};
  for (int64_t g = 0; g < groups; ++g) {
    const v8f e = exp_nonpositive_v8(load8(row + 8 * g) - mv);
    const v8f p = lane + static_cast<int32_t>(8 * g) < static_cast<int32_t>(limit) ? e : v8f{};
    store8(row + 8 * g, p);
    total += p;
  }
  float sum = 0.0f;
  for (int i = 0; i < 8; ++i) sum += total[i];
  const float alpha = exp_nonpositive(t.maxes[r] - mx);   // ~0 at the first chunk
  t.sums[r] = t.sums[r] * alpha + sum;
  t.maxes[r] = mx;
  return alpha;
}

template <int NC, typename T>
void attend_chunk_v8(const TileState& t, const KeyChunk<T>& c) {
  constexpr int64_t d = 8 * NC, kRows = 6;
  const int64_t segments = (c.count + kSegmentKeys - 1) / kSegmentKeys;
  for (int64_t i = 0; i < segments * kSegmentKeys; ++i) {   // kt[x * 64 + i]: key i's element x
    if (i < c.count) {
      const T* ki = c.key(i, t.stride);
      for (int64_t x = 0; x < d; ++x) t.kt[x * kChunkKeys + i] = to_float(ki[x]);
    } else {
      for (int64_t x = 0; x < d; ++x) t.kt[x * kChunkKeys + i] = 0.0f;
    }
  }
  for (int64_t r0 = 0; r0 < t.rows; r0 += kRows) {   // scores, 4 rows x 16 keys at a time
    const int64_t together = std::min(kRows, t.rows - r0);
    if (t.limit(c, r0 + together - 1) <= 0) continue;   // (causal: the last row takes the most)
    const float* q = t.q + r0 * d;
    for (int64_t g = 0; g < segments; ++g) {
      v8f acc[kRows][2] = {};
      for (int64_t x = 0; x < d; ++x) {
        const float* kx = t.kt + x * kChunkKeys + g * kSegmentKeys;
        const v8f k0 = load8(kx), k1 = load8(kx + 8);
        for (int64_t u = 0; u < kRows; ++u) {
          const v8f qx = splat8(q[(u < together ? u : 0) * d + x]);
          acc[u][0] += qx * k0;
          acc[u][1] += qx * k1;
        }
      }
      for (int64_t u = 0; u < together; ++u) {
        store8(t.scores + (r0 + u) * kChunkKeys + g * kSegmentKeys, acc[u][0]);
        store8(t.scores + (r0 + u) * kChunkKeys + g * kSegmentKeys + 8, acc[u][1]);
      }
    }
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t limit = t.limit(c, r);
    if (limit <= 0) continue;
    float* row = t.scores + r * kChunkKeys;
    const float alpha = softmax_update_v8(t, r, row, limit);
    float* a = t.acc + r * d;
    v8f out[NC];
    for (int c8 = 0; c8 < NC; ++c8) out[c8] = load8(a + 8 * c8) * alpha;
    for (int64_t i = 0; i < limit; ++i) {
      const v8f p = splat8(row[i]);
      const T* vi = c.value(i, t.stride);
      for (int c8 = 0; c8 < NC; ++c8) out[c8] += p * load8(vi + 8 * c8);
    }
    for (int c8 = 0; c8 < NC; ++c8) store8(a + 8 * c8, out[c8]);
  }
}

// Feeds tile (s, h)'s keys to flush(chunk), a chunk at a time: the cached positions block by
// block, then the step's own tokens up to j1 (causal: chunk.causal_first set).
template <typename KV, typename Flush>
void for_each_key_chunk(const PrefillStep<KV>& st, int64_t s, int64_t h, int64_t j1, Flush&& flush) {
  const int64_t d = st.head_dim, stride = st.num_kv_heads * d;
  KeyChunk<KV> cached;   // pool rows
  KeyChunk<float> own;   // the step's tokens
  auto emit = [&](auto& chunk) {
    if (chunk.count == 0) return;
    flush(chunk);
    chunk.count = 0;
  };
  // keys and values [first, first + n) of a stretch whose rows are `stride` apart, in segments
  auto add = [&](auto& chunk, const auto* k, const auto* v, int64_t n) {
    for (int64_t i = 0; i < n; i += kSegmentKeys) {
      const int64_t g = chunk.count / kSegmentKeys;
      chunk.keys[g] = k + i * stride;
      chunk.values[g] = v + i * stride;
      chunk.count += std::min(kSegmentKeys, n - i);
      if (chunk.count % kSegmentKeys != 0 || chunk.count == kChunkKeys) emit(chunk);   // a short segment ends a chunk
    }
  };
  // cached positions, block by block (the values' rows lie where the keys' do in their pool)
  for_each_block(st, s, h, st.key_cache, 0, st.context_lens[s], [&](const KV* k, int64_t, int64_t rows) {
    add(cached, k, st.value_cache + (k - st.key_cache), rows);
  });
  emit(cached);
  const int64_t base = (st.query_start_loc[s] * st.num_kv_heads + h) * d;   // the step's tokens, causal
  for (int64_t i0 = 0; i0 < j1; i0 += kChunkKeys) {
    own.causal_first = i0;
    add(own, st.key + base + i0 * stride, st.value + base + i0 * stride, std::min(kChunkKeys, j1 - i0));
    emit(own);
  }
}

// A tile's outputs: row r (token j0 + r / group, query head h * group + r % group) is its
// unnormalized output acc [rows, d] over its sum of exponentials.
template <typename KV>
inline void write_tile_outputs(const PrefillStep<KV>& st, int64_t s, int64_t h, int64_t j0, int64_t rows, int64_t d,
                               const float* acc, const float* sums) {
  const int64_t group = st.num_heads / st.num_kv_heads, q0 = st.query_start_loc[s];
  for (int64_t r = 0; r < rows; ++r) {
    float* out = st.output + ((q0 + j0 + r / group) * st.num_heads + h * group + r % group) * d;
    const float inv = 1.0f / sums[r];
    for (int64_t x = 0; x < d; ++x) out[x] = acc[r * d + x] * inv;
  }
}

#ifdef __AVX512F__
// AVX-512 tiles, head_dim D = 16 * NV: a flash-attention tile (FlashAttention-2, Dao 2023: the
// online softmax over key chunks) laid out for 16-float registers. The tile's queries are held
// transposed, qt [D][Rp] (Rp: rows rounded up to 16), so a chunk's scores come out transposed,
// st [key][Rp], as register tiles of 32 rows x 8 keys (one query load per 16 rows, one key
// element broadcast per 16 multiply-adds); the softmax over keys is then lane-wise (no
// horizontal max or sum); and the values go into register tiles of 24 / NV rows x D, one value
// vector load per 24 / NV multiply-adds. The chunk's keys and values are copied once, as float32
// rows (float16 pools converted), and past the chunk's end as zeros. Where the scalar-broadcast
// 8-float tiles (attend_chunk_v8) reached ~100 GFLOP/s on a 2-core Zen 5, these reach ~2x.
struct Tile16 {
  float* qt;      // [D][Rp]: the queries times scale, transposed (padding rows 0)
  float* acc;     // [Rp][D]: unnormalized outputs
  float* maxes;   // [Rp]: running max (-3e38 before the first key)
  float* sums;    // [Rp]: running sum of exponentials
  float* alpha;   // [Rp]: this chunk's rescale factors
  float* token;   // [Rp]: row r's step-token index, j0 + r / group (padding rows: -1, never causal-visible)
  float* st;      // [kChunkKeys][Rp]: scores, then probabilities
  float* kv;      // [2][kChunkKeys][D]: the chunk's keys, then values, as float32 rows
  int64_t rows, rp, stride;
};

// Keys [0, n) of chunk c that row last_row (a block's last real row: the causally widest) may take.
template <typename T>
inline int64_t visible_keys(const Tile16& t, const KeyChunk<T>& c, int64_t last_row) {
  if (c.causal_first < 0) return c.count;
  const int64_t tok = static_cast<int64_t>(t.token[last_row]);
  return std::max<int64_t>(0, std::min(c.count, tok - c.causal_first + 1));
}

template <int NV, typename T>
void attend_chunk16(const Tile16& t, const KeyChunk<T>& c) {
  constexpr int64_t D = 16 * NV, kScoreKeys = 8, kPvRows = 24 / NV;
  const int64_t n = c.count, rp = t.rp;
  float* const keys = t.kv;
  float* const values = t.kv + kChunkKeys * D;
  const int64_t n8 = (n + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
  for (int64_t i = 0; i < n; ++i) {
    const T* k = c.key(i, t.stride);
    const T* v = c.value(i, t.stride);
    for (int x = 0; x < NV; ++x) {
      _mm512_storeu_ps(keys + i * D + 16 * x, load_ps16(k + 16 * x));
      _mm512_storeu_ps(values + i * D + 16 * x, load_ps16(v + 16 * x));
    }
  }
  std::fill(keys + n * D, keys + n8 * D, 0.0f);
  // scores, transposed: st[i][r] = q_r . k_i, 32 rows (or 16) x 8 keys a register tile
  for (int64_t r0 = 0; r0 < rp; r0 += 32) {
    const bool two = r0 + 16 < rp;
    const int64_t limit = visible_keys(t, c, std::min(r0 + (two ? 31 : 15), t.rows - 1));
    for (int64_t i0 = 0; i0 < limit; i0 += kScoreKeys) {
      __m512 a0[kScoreKeys], a1[kScoreKeys];
      for (int u = 0; u < kScoreKeys; ++u) a0[u] = a1[u] = _mm512_setzero_ps();
      const float* kr = keys + i0 * D;
      if (two) {
        for (int64_t x = 0; x < D; ++x) {
          const __m512 q0 = _mm512_loadu_ps(t.qt + x * rp + r0), q1 = _mm512_loadu_ps(t.qt + x * rp + r0 + 16);
          for (int u = 0; u < kScoreKeys; ++u) {
            const __m512 b = _mm512_set1_ps(kr[u * D + x]);
            a0[u] = _mm512_fmadd_ps(q0, b, a0[u]);
            a1[u] = _mm512_fmadd_ps(q1, b, a1[u]);
          }
        }
        for (int u = 0; u < kScoreKeys; ++u) _mm512_storeu_ps(t.st + (i0 + u) * rp + r0 + 16, a1[u]);
      } else {
        for (int64_t x = 0; x < D; ++x) {
          const __m512 q0 = _mm512_loadu_ps(t.qt + x * rp + r0);
          for (int u = 0; u < kScoreKeys; ++u) a0[u] = _mm512_fmadd_ps(q0, _mm512_set1_ps(kr[u * D + x]), a0[u]);
        }
      }
      for (int u = 0; u < kScoreKeys; ++u) _mm512_storeu_ps(t.st + (i0 + u) * rp + r0, a0[u]);
    }
  }
  // the online-softmax update, 16 rows at a time, lane-wise over the keys (row r takes key i
  // where causal_first < 0 or token[r] >= causal_first + i; the others get probability 0)
  for (int64_t r0 = 0; r0 < rp; r0 += 16) {
    const int64_t limit = visible_keys(t, c, std::min(r0 + 15, t.rows - 1));
    const __m512 tok = _mm512_loadu_ps(t.token + r0), old = _mm512_loadu_ps(t.maxes + r0);
    __m512 m = old;
    const bool causal = c.causal_first >= 0;
    for (int64_t i = 0; i < limit; ++i) {
      const __m512 s = _mm512_loadu_ps(t.st + i * rp + r0);
      const __mmask16 take = causal ? _mm512_cmp_ps_mask(tok, _mm512_set1_ps(static_cast<float>(c.causal_first + i)), _CMP_GE_OQ)
                                    : static_cast<__mmask16>(0xffff);
      m = _mm512_mask_max_ps(m, take, m, s);
    }
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < limit; ++i) {
      const __m512 s = _mm512_loadu_ps(t.st + i * rp + r0);
      const __mmask16 take = causal ? _mm512_cmp_ps_mask(tok, _mm512_set1_ps(static_cast<float>(c.causal_first + i)), _CMP_GE_OQ)
                                    : static_cast<__mmask16>(0xffff);
      const __m512 p = _mm512_maskz_mov_ps(take, exp_nonpositive16(_mm512_sub_ps(s, m)));
      _mm512_storeu_ps(t.st + i * rp + r0, p);
      total = _mm512_add_ps(total, p);
    }
    // (keys these rows cannot take: 0, for the value tiles below, which may span two groups)
    for (int64_t i = limit; i < n; ++i) _mm512_storeu_ps(t.st + i * rp + r0, _mm512_setzero_ps());
    const __m512 alpha = exp_nonpositive16(_mm512_sub_ps(old, m));   // ~0 at a row's first key, 1 with none here
    _mm512_storeu_ps(t.alpha + r0, alpha);
    _mm512_storeu_ps(t.sums + r0, _mm512_fmadd_ps(_mm512_loadu_ps(t.sums + r0), alpha, total));
    _mm512_storeu_ps(t.maxes + r0, m);
  }
  // outputs: acc[r] = acc[r] * alpha[r] + sum_i p[i][r] v_i, kPvRows rows x D a register tile
  for (int64_t r0 = 0; r0 < t.rows; r0 += kPvRows) {
    const int64_t nr = std::min(kPvRows, t.rows - r0);
    const int64_t limit = visible_keys(t, c, r0 + nr - 1);
    if (limit == 0) continue;   // (no key here for any of these rows: alpha is 1)
    __m512 o[kPvRows][NV];
    for (int64_t u = 0; u < kPvRows; ++u) {
      const int64_t r = r0 + (u < nr ? u : 0);
      const __m512 al = _mm512_set1_ps(t.alpha[r]);
      for (int x = 0; x < NV; ++x) o[u][x] = _mm512_mul_ps(_mm512_loadu_ps(t.acc + r * D + 16 * x), al);
    }
    for (int64_t i = 0; i < limit; ++i) {
      __m512 v[NV];
      for (int x = 0; x < NV; ++x) v[x] = _mm512_loadu_ps(values + i * D + 16 * x);
      const float* p = t.st + i * rp + r0;
      for (int64_t u = 0; u < kPvRows; ++u) {
        const __m512 pu = _mm512_set1_ps(p[u < nr ? u : 0]);
        for (int x = 0; x < NV; ++x) o[u][x] = _mm512_fmadd_ps(pu, v[x], o[u][x]);
      }
    }
    for (int64_t u = 0; u < nr; ++u)
      for (int x = 0; x < NV; ++x) _mm512_storeu_ps(t.acc + (r0 + u) * D + 16 * x, o[u][x]);
  }
}

template <int NV, typename KV>
void attend_tile16(const PrefillStep<KV>& st, int64_t s, int64_t h, int64_t j0) {
  constexpr int64_t D = 16 * NV;
  const int64_t group = st.num_heads / st.num_kv_heads, q0 = st.query_start_loc[s];
  const int64_t j1 = std::min(st.query_start_loc[s + 1] - q0, j0 + st.tile), rows = (j1 - j0) * group;
  const int64_t rp = (rows + 15) / 16 * 16;
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(2 * D * rp + 4 * rp + kChunkKeys * rp + 2 * kChunkKeys * D));
  float* b = buffer.data();
  Tile16 t{b, b + D * rp, b + 2 * D * rp, b + 2 * D * rp + rp, b + 2 * D * rp + 2 * rp, b + 2 * D * rp + 3 * rp,
           b + 2 * D * rp + 4 * rp, b + 2 * D * rp + 4 * rp + kChunkKeys * rp, rows, rp, st.num_kv_heads * D};
  for (int64_t r = 0; r < rp; ++r) {
    const float* src = r < rows ? st.query + ((q0 + j0 + r / group) * st.num_heads + h * group + r % group) * D : nullptr;
    for (int64_t x = 0; x < D; ++x) t.qt[x * rp + r] = src ? src[x] * st.scale : 0.0f;
    t.token[r] = r < rows ? static_cast<float>(j0 + r / group) : -1.0f;
  }
  std::fill(t.acc, t.acc + rp * D, 0.0f);
  std::fill(t.maxes, t.maxes + rp, -3.0e38f);
  std::fill(t.sums, t.sums + rp, 0.0f);
  for_each_key_chunk(st, s, h, j1, [&](const auto& chunk) { attend_chunk16<NV>(t, chunk); });
  write_tile_outputs(st, s, h, j0, rows, D, t.acc, t.sums);
}
#endif

// DT: head_dim when known at compile time (a multiple of 8 takes attend_chunk_v8; on AVX-512
// a multiple of 16 takes attend_tile16).
template <int DT, typename KV>
void attend_tile(const PrefillStep<KV>& st, int64_t s, int64_t h, int64_t j0) {
#ifdef __AVX512F__
  if constexpr (DT != 0 && DT % 16 == 0) return attend_tile16<DT / 16, KV>(st, s, h, j0);
#endif
  const int64_t d = DT ? DT : st.head_dim;
  const int64_t hkv = st.num_kv_heads, group = st.num_heads / hkv, stride = hkv * d;
  const int64_t q0 = st.query_start_loc[s], q_len = st.query_start_loc[s + 1] - q0;
  const int64_t j1 = std::min(q_len, j0 + st.tile), rows = (j1 - j0) * group;
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(rows * (2 * d + 2 + kChunkKeys) + d * kChunkKeys));
  float* q = buffer.data();
  TileState t{q, q + rows * d, q + 2 * rows * d, q + 2 * rows * d + rows, q + 2 * rows * d + 2 * rows,
              q + rows * (2 * d + 2 + kChunkKeys), rows, group, j0, d, stride};
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = st.query + ((q0 + j0 + r / group) * st.num_heads + h * group + r % group) * d;
    for (int64_t x = 0; x < d; ++x) q[r * d + x] = src[x] * st.scale;
  }
  std::fill(t.acc, t.acc + rows * d, 0.0f);
  std::fill(t.maxes, t.maxes + rows, -3.0e38f);
  std::fill(t.sums, t.sums + rows, 0.0f);
  for_each_key_chunk(st, s, h, j1, [&](const auto& chunk) {
    if constexpr (DT != 0 && DT % 8 == 0)
      attend_chunk_v8<DT / 8>(t, chunk);
    else
      attend_chunk(t, chunk);
  });
  write_tile_outputs(st, s, h, j0, rows, d, t.acc, t.sums);
}

template <typename KV>
void attend_prefill_item(void* user, size_t item) {
  const PrefillStep<KV>& st = *static_cast<const PrefillStep<KV>*>(user);
  const int64_t* it = st.items + 3 * static_cast<int64_t>(item);
  switch (st.head_dim) {
    case 16: return attend_tile<16, KV>(st, it[0], it[1], it[2]);
    case 32: return attend_tile<32, KV>(st, it[0], it[1], it[2]);
    case 64: return attend_tile<64, KV>(st, it[0], it[1], it[2]);
    case 128: return attend_tile<128, KV>(st, it[0], it[1], it[2]);
    default: return attend_tile<0, KV>(st, it[0], it[1], it[2]);
  }
}

// -- the op ------------------------------------------------------------------------------

// Inputs (builder/paged_attention.py, INPUT_NAMES): 0-4 query [T, H, D], key / value [T, Hkv, D],
// key_cache / value_cache [N, B, Hkv, D] float32 or float16 (both alike); 5 slot_mapping [T] (the runtime writes the
// new K/V: unused here), 6 block_tables [S, M], 7 context_lens [S], 8 query_start_loc [S + 1]
// int64; 9-22 the ONNX function body's metadata (METADATA_NAMES: optional, unused here).
constexpr size_t kNumInputs = 23, kNumRequired = 9;
constexpr ONNXTensorElementDataType kInputTypes[kNumInputs] = {
    kF32, kF32, kF32, kAnyType, kAnyType, kI64, kI64, kI64, kI64,    // the op's own inputs (pools: float32 or float16)
    kI64, kI64, kI64, kF32, kF32, kI64, kI64, kI64, kI64, kF32, kF32,  // the function body's metadata
    kBool, kBool, kBool};

struct Kernel : KernelBase {
  float scale = 1.0f;
  bool kv_write_in_op = false;
  OrtStatus* compute(OrtKernelContext* context) override;
};

// The step's K/V (rows [T, Hkv * D]) into the pool at slot_mapping (checked by the caller): float32
// as is, float16 from values already rounded to it (round_to_half).
inline void write_pool_rows(const float* rows, const int64_t* slots, int64_t T, int64_t width, float* pool) {
  for (int64_t t = 0; t < T; ++t) std::memcpy(pool + slots[t] * width, rows + t * width, sizeof(float) * width);
}
inline void write_pool_rows(const float* rows, const int64_t* slots, int64_t T, int64_t width, uint16_t* pool) {
  for (int64_t t = 0; t < T; ++t) {
    const float* row = rows + t * width;
    uint16_t* out = pool + slots[t] * width;
    int64_t i = 0;
#ifdef __F16C__   // 8 at a time (exact: the values are float16's already)
    for (; i + 8 <= width; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(row + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < width; ++i) {
      uint16_t h;
      if (!float_to_half_exact(row[i], &h)) h = 0x7e00;   // NaN (the only value not exact after rounding)
      out[i] = h;
    }
  }
}

// A checked step's inputs other than the pools (shapes: the op's inputs).
struct StepArgs {
  const float *query, *key, *value;
  const int64_t *block_tables, *context_lens, *query_start_loc;
  float* output;
  int64_t T, S, H, Hkv, D, B, M;
  bool all_decode;
  float scale;
};

template <typename KV>
OrtStatus* run_step(OrtKernelContext* context, const StepArgs& args, const KV* key_cache, const KV* value_cache);

OrtStatus* invalid(const std::string& message) { return error(ORT_INVALID_ARGUMENT, "PagedAttention: " + message); }

// Every sequence computing one token: the decode kernels above.
template <typename KV>
OrtStatus* run_decode(OrtKernelContext* context, DecodeStep<KV>& step, int64_t S) {
  [[maybe_unused]] const int64_t B = step.block_size, H = step.num_heads;
  const int64_t D = step.head_dim, Hkv = step.num_kv_heads;
  // a work item per sequence reads its pool rows contiguously (all KV heads: measured ~25%
  // faster than per-head items at 8-64 sequences on 2 cores, and, with the next block's
  // prefetches spread, 1.3-1.8x at 4-7 sequences); one sequence not chunked below: an item
  // per KV head keeps the threads busy
  step.heads_per_item = S >= kMinSequencesPerItemSplit ? Hkv : 1;
  // one thread below ~64 KiB of keys and values (waking the pool costs more than it saves: the
  // rule of QuantizedLinear's batch 1)
  int64_t kv_bytes = 0;
  for (int64_t s = 0; s < S; ++s) kv_bytes += step.context_lens[s] * Hkv * D * 2 * static_cast<int64_t>(sizeof(KV));
  const bool serial = kv_bytes < (64 << 10);
#if defined(__AVX512F__) || defined(TRTLLM_LITE_AVX2)
  // few sequences: chunks of the context over all KV heads (contiguous pool rows, every core
  // busy), where there are blocks enough to share. One sequence
  // (batch-1 latency): a multiple of the cores' count of even chunks, of kMinChunkBlocks blocks
  // or more where the context has them, so that every core works to the end (the rule below
  // gave 2 : 1 of the work at 129-192 tokens; SmolLM2 int4 batch 1 there 1.035x a step, level
  // at 640); a few: chunks of kMinChunkBlocks or more, about two items per core.
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) longest = std::max(longest, (step.context_lens[s] + B - 1) / B);
  const int64_t cores = static_cast<int64_t>(available_cores()), want = 2 * cores;
  const bool chunkable = D == 16 || D == 32 || D == 64 || D == 128;
  if (chunkable && S == 1 && cores > 1 && !serial && longest >= cores) {
    const int64_t chunks = cores * std::max<int64_t>(1, longest / (cores * kMinChunkBlocks));
    step.chunk_blocks = (longest + chunks - 1) / chunks;
  } else if (chunkable && S > 1 && S < want && longest >= 2 * kMinChunkBlocks) {
    const int64_t per_seq = (want + S - 1) / S;
    step.chunk_blocks = std::max(kMinChunkBlocks, (longest + per_seq - 1) / per_seq);
  }
  if (step.chunk_blocks > 0) {
    step.chunks_per_seq = (longest + step.chunk_blocks - 1) / step.chunk_blocks;
    thread_local std::vector<float> partial;
    partial.resize(static_cast<size_t>(S * step.chunks_per_seq * H * (D + 2)));
    step.partial = partial.data();
    step.heads_per_item = Hkv;
    RETURN_IF_ERROR(parallel_for(context, attend<KV>, static_cast<size_t>(S * step.chunks_per_seq), &step, false,
                                 std::min(static_cast<size_t>(S * step.chunks_per_seq), available_cores())));
    merge_chunks(step, S);
    return nullptr;
  }
#endif
  return parallel_for(context, attend<KV>, static_cast<size_t>(S * Hkv / step.heads_per_item), &step, serial);
}

// A decode step (token s is sequence s's) over these tensors (shapes: the op's inputs).
template <typename KV>
DecodeStep<KV> decode_step(const float* query, const float* key, const float* value, const KV* key_cache,
                           const KV* value_cache, const int64_t* block_tables, const int64_t* context_lens,
                           float* output, int64_t H, int64_t Hkv, int64_t D, int64_t B, int64_t M, float scale) {
  DecodeStep<KV> step{};
  step.query = query;
  step.key = key;
  step.value = value;
  step.key_cache = key_cache;
  step.value_cache = value_cache;
  step.block_tables = block_tables;
  step.context_lens = context_lens;
  step.output = output;
  step.num_heads = H;
  step.num_kv_heads = Hkv;
  step.head_dim = D;
  step.block_size = B;
  step.max_blocks = M;
  step.scale = scale;
  return step;
}

// The one-token sequences of a mixed step through run_decode: their query, new K/V, block
// table rows and context lengths copied into a decode step's layout, the outputs copied back.
template <typename KV>
OrtStatus* run_mixed_decodes(OrtKernelContext* context, const float* query, const float* key, const float* value,
                             const KV* key_cache, const KV* value_cache, const int64_t* block_tables,
                             const int64_t* context_lens, const int64_t* query_start_loc, float* output, int64_t S,
                             int64_t H, int64_t Hkv, int64_t D, int64_t B, int64_t M, float scale) {
  thread_local std::vector<int64_t> seqs, tables, lens;
  thread_local std::vector<float> q, k, v, out;
  seqs.clear();
  for (int64_t s = 0; s < S; ++s)
    if (query_start_loc[s + 1] - query_start_loc[s] == 1) seqs.push_back(s);
  const int64_t n = static_cast<int64_t>(seqs.size());
  if (n == 0) return nullptr;
  const auto size = [](int64_t x) { return static_cast<size_t>(x); };
  q.resize(size(n * H * D));
  k.resize(size(n * Hkv * D));
  v.resize(size(n * Hkv * D));
  out.resize(size(n * H * D));
  tables.resize(size(n * M));
  lens.resize(size(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = seqs[size(i)], token = query_start_loc[s];
    std::memcpy(q.data() + i * H * D, query + token * H * D, sizeof(float) * size(H * D));
    std::memcpy(k.data() + i * Hkv * D, key + token * Hkv * D, sizeof(float) * size(Hkv * D));
    std::memcpy(v.data() + i * Hkv * D, value + token * Hkv * D, sizeof(float) * size(Hkv * D));
    std::memcpy(tables.data() + i * M, block_tables + s * M, sizeof(int64_t) * size(M));
    lens[size(i)] = context_lens[s];
  }
  DecodeStep<KV> step = decode_step(q.data(), k.data(), v.data(), key_cache, value_cache, tables.data(),
                                    lens.data(), out.data(), H, Hkv, D, B, M, scale);
  RETURN_IF_ERROR(run_decode(context, step, n));
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(output + query_start_loc[seqs[size(i)]] * H * D, out.data() + i * H * D, sizeof(float) * size(H * D));
  return nullptr;
}

OrtStatus* Kernel::compute(OrtKernelContext* context) {
  Tensor t[kNumRequired];
  for (size_t i = 0; i < kNumRequired; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  const char* names[kNumRequired] = {"query", "key", "value", "key_cache", "value_cache", "slot_mapping",
                                     "block_tables", "context_lens", "query_start_loc"};
  const size_t ranks[kNumRequired] = {3, 3, 3, 4, 4, 1, 2, 1, 1};
  for (size_t i = 0; i < kNumRequired; ++i)
    if (t[i].dims.size() != ranks[i])
      return invalid(std::string(names[i]) + " has shape " + dims_string(t[i].dims) + ", expected rank " +
                     std::to_string(ranks[i]));
  const int64_t T = t[0].dims[0], H = t[0].dims[1], D = t[0].dims[2];
  const int64_t Hkv = t[1].dims[1], N = t[3].dims[0], B = t[3].dims[1], S = t[6].dims[0], M = t[6].dims[1];
  const Dims kv_dims{T, Hkv, D}, pool_dims{N, B, Hkv, D};
  if (B < 1)   // (the block walks divide by it)
    return invalid("key_cache / value_cache hold blocks of " + std::to_string(B) + " slots (dimension 1); at least 1");
  if (Hkv <= 0 || H % Hkv != 0)
    return invalid("query heads " + std::to_string(H) + " are not a multiple of key heads " + std::to_string(Hkv));
  if (t[1].dims != kv_dims || t[2].dims != kv_dims)
    return invalid("key / value shapes " + dims_string(t[1].dims) + " / " + dims_string(t[2].dims) + ", expected " +
                   dims_string(kv_dims));
  if (t[3].dims != pool_dims || t[4].dims != pool_dims)
    return invalid("key_cache / value_cache shapes " + dims_string(t[3].dims) + " / " + dims_string(t[4].dims) +
                   ", expected [num_blocks, block_size, " + std::to_string(Hkv) + ", " + std::to_string(D) + "]");
  if ((t[3].type != kF32 && t[3].type != kF16) || t[4].type != t[3].type)
    return invalid("key_cache / value_cache must both be float32 or both float16 (element types " +
                   std::to_string(t[3].type) + " / " + std::to_string(t[4].type) + ")");
  if (t[7].dims[0] != S || t[8].dims[0] != S + 1)
    return invalid("context_lens " + dims_string(t[7].dims) + " / query_start_loc " + dims_string(t[8].dims) +
                   " do not match block_tables' " + std::to_string(S) + " sequences");
  const int64_t *block_tables, *context_lens, *query_start_loc;
  RETURN_IF_ERROR(data_of(t[6], &block_tables));
  RETURN_IF_ERROR(data_of(t[7], &context_lens));
  RETURN_IF_ERROR(data_of(t[8], &query_start_loc));
  // every position the step reads must be there: the kernels read them unchecked
  if (query_start_loc[0] != 0 || query_start_loc[S] != T)   // (also: tokens but no sequence)
    return invalid("query_start_loc runs from " + std::to_string(query_start_loc[0]) + " to " +
                   std::to_string(query_start_loc[S]) + ", expected 0 to the step's " + std::to_string(T) + " tokens");
  bool all_decode = T == S;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s], ctx = context_lens[s];
    if (q_len < 0)
      return invalid("query_start_loc[" + std::to_string(s + 1) + "] = " + std::to_string(query_start_loc[s + 1]) +
                     " is below query_start_loc[" + std::to_string(s) + "] = " + std::to_string(query_start_loc[s]));
    all_decode = all_decode && q_len == 1;
    if (ctx < 0 || ctx > M * B)
      return invalid("context_lens[" + std::to_string(s) + "] = " + std::to_string(ctx) + " outside [0, " +
                     std::to_string(M * B) + "]");
    for (int64_t b = 0; b < (ctx + B - 1) / B; ++b) {
      const int64_t block = block_tables[s * M + b];
      if (block < 0 || block >= N)
        return invalid("block_tables[" + std::to_string(s) + ", " + std::to_string(b) + "] = " +
                       std::to_string(block) + " outside the pool's " + std::to_string(N) + " blocks");
    }
  }
  const int64_t* slots = nullptr;
  if (kv_write_in_op) {
    if (t[5].dims[0] != T)
      return invalid("slot_mapping " + dims_string(t[5].dims) + " does not match the step's " + std::to_string(T) +
                     " tokens");
    RETURN_IF_ERROR(data_of(t[5], &slots));
    for (int64_t i = 0; i < T; ++i)
      if (slots[i] < 0 || slots[i] >= N * B)
        return invalid("slot_mapping[" + std::to_string(i) + "] = " + std::to_string(slots[i]) + " outside the pool's " +
                       std::to_string(N * B) + " slots");
  }
  float* output;
  RETURN_IF_ERROR(new_output(context, 0, {T, H, D}, &output));
  if (T == 0) return nullptr;
  const float *query, *key, *value;
  RETURN_IF_ERROR(data_of(t[0], &query));
  RETURN_IF_ERROR(data_of(t[1], &key));
  RETURN_IF_ERROR(data_of(t[2], &value));
  const StepArgs args{query, key, value, block_tables, context_lens, query_start_loc, output, T, S, H, Hkv, D, B, M,
                      all_decode, scale};
  if (t[3].type == kF16) {
    const uint16_t *key_cache, *value_cache;
    RETURN_IF_ERROR(data_of(t[3], &key_cache));
    RETURN_IF_ERROR(data_of(t[4], &value_cache));
    // the step's new K/V attended as the pool will hold them (the runtime stores them rounded
    // to float16 after the step), so the same values are attended however a prompt was chunked
    // or prefix-cached; vLLM's kernels read them back from the cache alike
    thread_local std::vector<float> rounded;
    const size_t n = static_cast<size_t>(T * Hkv * D);
    rounded.resize(2 * n);
    round_to_half_n(key, n, rounded.data());
    round_to_half_n(value, n, rounded.data() + n);
    StepArgs half_args = args;
    half_args.key = rounded.data();
    half_args.value = rounded.data() + n;
    if (slots) {   // positions >= each sequence's context: none of them is read from the pool this step
      write_pool_rows(rounded.data(), slots, T, Hkv * D, const_cast<uint16_t*>(key_cache));
      write_pool_rows(rounded.data() + n, slots, T, Hkv * D, const_cast<uint16_t*>(value_cache));
    }
    return run_step(context, half_args, key_cache, value_cache);
  }
  const float *key_cache, *value_cache;
  RETURN_IF_ERROR(data_of(t[3], &key_cache));
  RETURN_IF_ERROR(data_of(t[4], &value_cache));
  if (slots) {
    write_pool_rows(key, slots, T, Hkv * D, const_cast<float*>(key_cache));
    write_pool_rows(value, slots, T, Hkv * D, const_cast<float*>(value_cache));
  }
  return run_step(context, args, key_cache, value_cache);
}

// Query rows (tokens x a KV head's query heads) per prompt tile: on AVX-512, three of
// attend_tile16's 32-row score tiles (96 against 128 rows: 0.90-1.00x the time on SmolLM2's
// heads, paired calls; 256 rows: 1.03-1.6x, the causal half of the diagonal tiles wasted).
#ifdef __AVX512F__
constexpr int64_t kPrefillTileRows = 96;
#else
constexpr int64_t kPrefillTileRows = 128;
#endif

template <typename KV>
OrtStatus* run_step(OrtKernelContext* context, const StepArgs& a, const KV* key_cache, const KV* value_cache) {
  const float *query = a.query, *key = a.key, *value = a.value;
  const float scale = a.scale;
  const int64_t *block_tables = a.block_tables, *context_lens = a.context_lens, *query_start_loc = a.query_start_loc;
  float* output = a.output;
  const int64_t S = a.S, H = a.H, Hkv = a.Hkv, D = a.D, B = a.B, M = a.M;
  if (a.all_decode) {   // token s is sequence s's
    DecodeStep<KV> step = decode_step(query, key, value, key_cache, value_cache, block_tables, context_lens, output,
                                      H, Hkv, D, B, M, scale);
    return run_decode(context, step, S);
  }
  // A step that mixes decodes with prompt chunks or draft verifications: the decodes run the
  // decode kernels (on copies laid out as a decode step's, token i = sequence i), which read
  // the context at about twice the rate of one-token tiles (63 decodes at 475 tokens beside a
  // 2-token prompt: 7.9-9.2 ms a layer through the tiles, 3.5-4.1 ms this way); the rest runs
  // the tiles.
  RETURN_IF_ERROR(run_mixed_decodes(context, query, key, value, key_cache, value_cache, block_tables, context_lens,
                                    query_start_loc, output, S, H, Hkv, D, B, M, scale));
  const int64_t group = H / Hkv;
  PrefillStep<KV> step{query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc, output,
                       H, Hkv, D, B, M, std::max<int64_t>(1, kPrefillTileRows / group), nullptr, scale};
  // work items (sequence, KV head, tile), the longest (latest tiles: the most keys) first
  thread_local std::vector<std::array<int64_t, 3>> items;
  items.clear();
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    if (q_len == 1) continue;   // run_mixed_decodes'
    for (int64_t j0 = 0; j0 < q_len; j0 += step.tile) {
      work += (context_lens[s] + std::min(q_len, j0 + step.tile)) * std::min(step.tile, q_len - j0);
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({s, h, j0});
    }
  }
  auto keys = [&](const std::array<int64_t, 3>& it) { return context_lens[it[0]] + it[2]; };
  if (items.empty()) return nullptr;
  std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) { return keys(a) > keys(b); });
  step.items = items.front().data();
  const int64_t num_items = static_cast<int64_t>(items.size());
  // one thread below kSerialWork multiply-adds (query-key pairs x heads x D x 2)
  return parallel_for(context, attend_prefill_item<KV>, static_cast<size_t>(num_items), &step,
                      work * H * D * 2 < kSerialWork);
}

OrtStatus* create_kernel(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<Kernel>(kernel, [info](Kernel& k) {
    int64_t in_op = 0;
    RETURN_IF_ERROR(optional_int_attribute(info, "kv_write_in_op", &in_op));
    if (in_op != 0 && in_op != 1) return invalid("kv_write_in_op must be 0 or 1, got " + std::to_string(in_op));
    k.kv_write_in_op = in_op == 1;
    return float_attribute(info, "scale", &k.scale);
  });
}

}  // namespace

KernelBase* new_paged_attention(float scale, bool kv_write_in_op) {
  Kernel* k = new Kernel();
  k->scale = scale;
  k->kv_write_in_op = kv_write_in_op;
  return k;
}

const OrtCustomOp* paged_attention_op() {
  static const CustomOp op({"PagedAttention", kInputTypes, kNumInputs, 1, create_kernel, kNumRequired});
  return &op;
}

}  // namespace trtllm_lite_kernels
