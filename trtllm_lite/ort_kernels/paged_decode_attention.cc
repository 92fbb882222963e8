// trtllm_lite::PagedDecodeAttention for ONNX Runtime's CPU execution provider.
//
// The PagedAttention op's decode step (every sequence computes one token), read straight from
// the paged KV pool: for each sequence (or, with few sequences, each chunk of a sequence's
// context, or each (sequence, KV head) pair, so every thread has work) the kernel walks the sequence's blocks through its block table
// twice (scores, then the weighted sum of values), fetching the next block ahead (blocks lie
// anywhere in the pool, where the hardware prefetcher cannot follow), with no gathered copy,
// no padding to the step's longest context and no mask. The ONNX function body it replaces
// (builder/paged_attention.py, make_decode_function) gathers every used block into a new
// tensor for K and for V, then runs MatMuls over the copies.
//
// Inputs (builder/paged_attention.py, DECODE_INPUT_NAMES; S sequences, one token each):
//   0 query        [S, H, D]          float32
//   1 key          [S, Hkv, D]        float32   the new token's K (rotary applied)
//   2 value        [S, Hkv, D]        float32   the new token's V
//   3 key_cache    [N, B, Hkv, D]     float32   this layer's K pool
//   4 value_cache  [N, B, Hkv, D]     float32
//   5 block_tables [S, M]             int64     logical -> physical block
//   6 context_lens [S]                int64     tokens cached before this step
//   7-15 the function body's decode metadata (unused here)
// Attribute: scale (float). Output: [S, H, D] float32.
// Query head h reads KV head h / (H / Hkv) (grouped-query attention).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernel_common.h"

namespace trtllm_lite_kernels {
namespace {

constexpr size_t kNumInputs = 16;
constexpr int64_t kMinSequencesPerItemSplit = 8;
constexpr int64_t kMinChunkBlocks = 4;   // context blocks per chunk at least (few sequences)
constexpr ONNXTensorElementDataType kInputTypes[kNumInputs] = {
    kF32, kF32, kF32, kF32, kF32, kI64, kI64,            // the op's own inputs
    kI64, kF32, kI64, kI64, kI64, kI64, kF32, kF32, kBool  // the function body's metadata
};

struct DecodeStep {
  const float *query, *key, *value, *key_cache, *value_cache;
  const int64_t *block_tables, *context_lens;
  float* output;
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t heads_per_item;   // KV heads one work item takes: all of them, or 1 when few sequences
  // Few sequences (AVX-512 and AVX2 paths): each sequence's context in chunks of chunk_blocks blocks, a
  // work item per (sequence, chunk) over all KV heads; the items leave partial softmax results
  // (row max, sum of exponentials, unnormalized output) that merge_chunks combines
  // (flash-decoding's split-KV: Dao et al. 2023, "Flash-Decoding for long-context inference").
  int64_t chunks_per_seq = 1, chunk_blocks = 0;
  float* partial = nullptr;   // [S * chunks_per_seq, H, D + 2]: D sums, then max, sum
  float scale;
};

// The pool rows of sequence s from KV head h on, block by block, for cached positions
// [begin, end) (begin a multiple of the block size): fn(row pointer, first position, rows) for
// each block, the next block prefetched.
template <typename Fn>
inline void for_each_block(const DecodeStep& st, int64_t s, int64_t h, const float* pool, int64_t begin,
                           int64_t end, Fn fn) {
  const int64_t bs = st.block_size, hkv = st.num_kv_heads, d = st.head_dim;
  const int64_t* table = st.block_tables + s * st.max_blocks;
  const int64_t block_floats = bs * hkv * d;
  for (int64_t start = begin; start < end; start += bs) {
    if (start + bs < end) {   // blocks lie anywhere in the pool: fetch the next one ahead
      const char* next = reinterpret_cast<const char*>(pool + table[start / bs + 1] * block_floats);
      for (int64_t line = 0; line < block_floats * 4; line += 64) __builtin_prefetch(next + line);
    }
    fn(pool + table[start / bs] * block_floats + h * d, start, std::min(bs, end - start));
  }
}

// Portable version: any head_dim. scores [G, n] (n = ctx + 1), acc [G, D] scratch.
void attend_portable(const DecodeStep& st, int64_t s, int64_t h, float* scores, float* acc) {
  const int64_t hkv = st.num_kv_heads, d = st.head_dim, group = st.num_heads / hkv;
  const int64_t ctx = st.context_lens[s], n = ctx + 1, stride = hkv * d;
  const float* q = st.query + (s * st.num_heads + h * group) * d;   // [G, D]
  auto score_row = [&](const float* k, int64_t pos) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) dot += qg[i] * k[i];
      scores[g * n + pos] = dot * st.scale;
    }
  };
  for_each_block(st, s, h, st.key_cache, 0, ctx, [&](const float* k, int64_t first, int64_t rows) {
    for (int64_t j = 0; j < rows; ++j) score_row(k + j * stride, first + j);
  });
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
  auto add_row = [&](const float* v, int64_t pos) {
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + pos];
      float* a = acc + g * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] += p * v[i];
    }
  };
  for_each_block(st, s, h, st.value_cache, 0, ctx, [&](const float* v, int64_t first, int64_t rows) {
    for (int64_t j = 0; j < rows; ++j) add_row(v + j * stride, first + j);
  });
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
// and adds for 16 sums where 16 horizontal sums take ~128.
inline __m512 sum16(const __m512 v[16]) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)   // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)   // per 128-bit lane: that lane's sums of v[4k .. 4k + 3]
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; ++k)   // 128-bit lanes [u0 + u1, u2 + u3] of u[2k], then of u[2k + 1]
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// AVX-512 version for head_dim = 16 * NC: KV heads [h0, h0 + nh) of sequence s, each pool row
// read from memory once for all of them (one contiguous nh * D stretch), then from L1 for each
// of a KV head's query heads (a block's scores 16 positions at a time, its values summed in
// registers).
// Cached positions [begin, end), plus the new token when with_new (the last chunk). partial:
// null to write the normalized output, else [rows, D + 2] for merge_chunks (all KV heads).
template <int NC>
void attend_avx512(const DecodeStep& st, int64_t s, int64_t h0, int64_t nh, int64_t begin, int64_t end,
                   bool with_new, float* scores, float* acc, float* partial) {
  constexpr int64_t d = 16 * NC;
  const int64_t hkv = st.num_kv_heads, group = st.num_heads / hkv, rows = nh * group;
  const int64_t ctx = st.context_lens[s], stride = hkv * d;
  const int64_t n = end - begin + (with_new ? 1 : 0);
  if (n == 0) return write_empty_partial(partial, rows, d);   // a shorter sequence's chunk
  const float* q = st.query + (s * st.num_heads + h0 * group) * d;   // [rows, D]
  float* q_scaled = acc;                        // [rows, D] scratch, reused for the sums below
  for (int64_t i = 0; i < rows * d; ++i) q_scaled[i] = q[i] * st.scale;

  // scores of up to 16 positions at a time: 16 dot-product vectors, then one transpose-add
  // (sum16) into a vector of 16 scores, instead of a horizontal sum per position
  auto score_rows = [&](const float* k, int64_t first, int64_t len) {   // k: head h0's row at first
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const int64_t tile = std::min<int64_t>(16, len - j0);
      const __mmask16 mask = static_cast<__mmask16>((1u << tile) - 1);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float* kh = k + j0 * stride + hh * d;
        for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
          __m512 qv[NC], dots[16];
          for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(q_scaled + g * d + 16 * c);
          for (int64_t j = 0; j < 16; ++j) {
            if (j >= tile) {
              dots[j] = _mm512_setzero_ps();
              continue;
            }
            const float* kr = kh + j * stride;
            __m512 dot = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
            for (int c = 1; c < NC; ++c) dot = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), dot);
            dots[j] = dot;
          }
          _mm512_mask_storeu_ps(scores + g * n + first + j0 - begin, mask, sum16(dots));
        }
      }
    }
  };
  for_each_block(st, s, h0, st.key_cache, begin, end, score_rows);
  if (with_new) score_rows(st.key + (s * hkv + h0) * d, ctx, 1);

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
  auto add_rows = [&](const float* v, int64_t first, int64_t len) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      const float* vh = v + hh * d;
      for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
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
          const float *v0 = vh + j * stride, *v1 = v0 + stride;
          for (int c = 0; c < NC; ++c) {
            even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
            odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), odd[c]);
          }
        }
        if (j < len) {
          const __m512 p0 = _mm512_set1_ps(p[j]);
          for (int c = 0; c < NC; ++c) even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vh + j * stride + 16 * c), even[c]);
        }
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_add_ps(even[c], odd[c]));
      }
    }
  };
  for_each_block(st, s, h0, st.value_cache, begin, end, add_rows);
  if (with_new) add_rows(st.value + (s * hkv + h0) * d, ctx, 1);
  if (partial) return write_partial(partial, acc, maxes.data(), inv_total.data(), rows, d);
  float* out = st.output + (s * st.num_heads + h0 * group) * d;
  for (int64_t g = 0; g < rows; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / inv_total[g]);
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(out + g * d + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + 16 * c), inv));
  }
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
template <int NC>
void attend_avx2(const DecodeStep& st, int64_t s, int64_t h0, int64_t nh, int64_t begin, int64_t end,
                 bool with_new, float* scores, float* acc, float* partial) {
  constexpr int64_t d = 8 * NC;
  const int64_t hkv = st.num_kv_heads, group = st.num_heads / hkv, rows = nh * group;
  const int64_t ctx = st.context_lens[s], stride = hkv * d;
  const int64_t n = end - begin + (with_new ? 1 : 0);
  if (n == 0) return write_empty_partial(partial, rows, d);   // a shorter sequence's chunk
  const float* q = st.query + (s * st.num_heads + h0 * group) * d;   // [rows, D]
  float* q_scaled = acc;                        // [rows, D] scratch, reused for the sums below
  for (int64_t i = 0; i < rows * d; ++i) q_scaled[i] = q[i] * st.scale;

  auto score_rows = [&](const float* k, int64_t first, int64_t len) {   // k: head h0's row at first
    for (int64_t j0 = 0; j0 < len; j0 += 8) {
      const int64_t tile = std::min<int64_t>(8, len - j0);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float* kh = k + j0 * stride + hh * d;
        for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
          const float* qg = q_scaled + g * d;
          __m256 dots[8];
          for (int64_t j = 0; j < 8; ++j) {
            if (j >= tile) {
              dots[j] = _mm256_setzero_ps();
              continue;
            }
            const float* kr = kh + j * stride;
            __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(kr));
            for (int c = 1; c < NC; ++c) dot = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(kr + 8 * c), dot);
            dots[j] = dot;
          }
          alignas(32) float tile_scores[8];
          _mm256_store_ps(tile_scores, sum8(dots));
          std::memcpy(scores + g * n + first + j0 - begin, tile_scores, sizeof(float) * static_cast<size_t>(tile));
        }
      }
    }
  };
  for_each_block(st, s, h0, st.key_cache, begin, end, score_rows);
  if (with_new) score_rows(st.key + (s * hkv + h0) * d, ctx, 1);

  thread_local std::vector<float> inv_total, maxes;
  inv_total.resize(static_cast<size_t>(rows));
  maxes.resize(static_cast<size_t>(rows));
  for (int64_t g = 0; g < rows; ++g) {          // exponentials in place, their sum kept
    float* row = scores + g * n;
    float mx = row[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, row[i]);
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
  auto add_rows = [&](const float* v, int64_t first, int64_t len) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      const float* vh = v + hh * d;
      for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
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
            const float* vj = vh + (j + e) * stride;
            for (int c = 0; c < NC; ++c) sums[e][c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * c), sums[e][c]);
          }
        for (; j < len; ++j) {
          const __m256 pj = _mm256_set1_ps(p[j]);
          for (int c = 0; c < NC; ++c) sums[0][c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vh + j * stride + 8 * c), sums[0][c]);
        }
        for (int c = 0; c < NC; ++c)
          _mm256_storeu_ps(a + 8 * c, kSets == 2 ? _mm256_add_ps(sums[0][c], sums[kSets - 1][c]) : sums[0][c]);
      }
    }
  };
  for_each_block(st, s, h0, st.value_cache, begin, end, add_rows);
  if (with_new) add_rows(st.value + (s * hkv + h0) * d, ctx, 1);
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
void attend(void* user, size_t item) {
  const DecodeStep& st = *static_cast<const DecodeStep*>(user);
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
      case 16: return attend_avx512<1>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 32: return attend_avx512<2>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 64: return attend_avx512<4>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 128: return attend_avx512<8>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
#else
      case 16: return attend_avx2<2>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 32: return attend_avx2<4>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 64: return attend_avx2<8>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
      case 128: return attend_avx2<16>(st, s, 0, hkv, begin, end, last, scores, acc, partial);
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
    case 16: return attend_avx512<1>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 32: return attend_avx512<2>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 64: return attend_avx512<4>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 128: return attend_avx512<8>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    default: break;
  }
#elif defined(TRTLLM_LITE_AVX2)
  switch (st.head_dim) {
    case 16: return attend_avx2<2>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 32: return attend_avx2<4>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 64: return attend_avx2<8>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    case 128: return attend_avx2<16>(st, s, h0, nh, 0, ctx, true, scores, acc, nullptr);
    default: break;
  }
#endif
  for (int64_t h = h0; h < h0 + nh; ++h) attend_portable(st, s, h, scores, acc);
}

// The chunks' partial results -> the output: per query head, the maxima's max M, then
// sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
[[maybe_unused]] void merge_chunks(const DecodeStep& st, int64_t num_seqs) {
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

struct Kernel : KernelBase {
  float scale = 1.0f;
  OrtStatus* compute(OrtKernelContext* context) override;
};

OrtStatus* Kernel::compute(OrtKernelContext* context) {
  Tensor t[7];
  for (size_t i = 0; i < 7; ++i) RETURN_IF_ERROR(read_input(context, i, &t[i]));
  const char* names[7] = {"query", "key", "value", "key_cache", "value_cache", "block_tables", "context_lens"};
  const size_t ranks[7] = {3, 3, 3, 4, 4, 2, 1};
  for (size_t i = 0; i < 7; ++i)
    if (t[i].dims.size() != ranks[i])
      return error(ORT_INVALID_ARGUMENT, std::string("PagedDecodeAttention: ") + names[i] + " has shape " +
                                             dims_string(t[i].dims) + ", expected rank " + std::to_string(ranks[i]));
  const int64_t S = t[0].dims[0], H = t[0].dims[1], D = t[0].dims[2];
  const int64_t Hkv = t[1].dims[1], N = t[3].dims[0], B = t[3].dims[1], M = t[5].dims[1];
  const std::vector<int64_t> kv_dims{S, Hkv, D}, pool_dims{N, B, Hkv, D};
  if (Hkv <= 0 || H % Hkv != 0)
    return error(ORT_INVALID_ARGUMENT, "PagedDecodeAttention: query heads " + std::to_string(H) +
                                           " are not a multiple of key heads " + std::to_string(Hkv));
  if (t[1].dims != kv_dims || t[2].dims != kv_dims)
    return error(ORT_INVALID_ARGUMENT, "PagedDecodeAttention: key / value shapes " + dims_string(t[1].dims) +
                                           " / " + dims_string(t[2].dims) + ", expected " + dims_string(kv_dims));
  if (t[3].dims != pool_dims || t[4].dims != pool_dims)
    return error(ORT_INVALID_ARGUMENT, "PagedDecodeAttention: key_cache / value_cache shapes " +
                                           dims_string(t[3].dims) + " / " + dims_string(t[4].dims) +
                                           ", expected [num_blocks, block_size, " + std::to_string(Hkv) + ", " +
                                           std::to_string(D) + "]");
  if (t[5].dims[0] != S || t[6].dims[0] != S)
    return error(ORT_INVALID_ARGUMENT, "PagedDecodeAttention: block_tables " + dims_string(t[5].dims) +
                                           " / context_lens " + dims_string(t[6].dims) + " do not have " +
                                           std::to_string(S) + " sequences (one query token each)");
  DecodeStep step{};
  RETURN_IF_ERROR(data_of(t[0].value, &step.query));
  RETURN_IF_ERROR(data_of(t[1].value, &step.key));
  RETURN_IF_ERROR(data_of(t[2].value, &step.value));
  RETURN_IF_ERROR(data_of(t[3].value, &step.key_cache));
  RETURN_IF_ERROR(data_of(t[4].value, &step.value_cache));
  RETURN_IF_ERROR(data_of(t[5].value, &step.block_tables));
  RETURN_IF_ERROR(data_of(t[6].value, &step.context_lens));
  // every block the step reads must be in the pool: the kernel reads it unchecked
  for (int64_t s = 0; s < S; ++s) {
    const int64_t ctx = step.context_lens[s];
    if (ctx < 0 || ctx > M * B)
      return error(ORT_INVALID_ARGUMENT, "PagedDecodeAttention: context_lens[" + std::to_string(s) + "] = " +
                                             std::to_string(ctx) + " outside [0, " + std::to_string(M * B) + "]");
    for (int64_t b = 0; b < (ctx + B - 1) / B; ++b) {
      const int64_t block = step.block_tables[s * M + b];
      if (block < 0 || block >= N)
        return error(ORT_INVALID_ARGUMENT, "PagedDecodeAttention: block_tables[" + std::to_string(s) + ", " +
                                               std::to_string(b) + "] = " + std::to_string(block) +
                                               " outside the pool's " + std::to_string(N) + " blocks");
    }
  }
  RETURN_IF_ERROR(new_output(context, 0, {S, H, D}, &step.output));
  if (S == 0) return nullptr;
  step.num_heads = H;
  step.num_kv_heads = Hkv;
  step.head_dim = D;
  step.block_size = B;
  step.max_blocks = M;
  step.scale = scale;
  // a work item per sequence reads its pool rows contiguously (all KV heads: measured ~25%
  // faster than per-head items at 8-64 sequences on 2 cores); with fewer sequences, a work
  // item per (sequence, KV head) keeps the threads busy
  step.heads_per_item = S >= kMinSequencesPerItemSplit ? Hkv : 1;
#if defined(__AVX512F__) || defined(TRTLLM_LITE_AVX2)
  // few sequences: chunks of the context over all KV heads (contiguous pool rows, every core
  // busy) instead of an item per KV head, where there are blocks enough to share
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) longest = std::max(longest, (step.context_lens[s] + B - 1) / B);
  const int64_t want = static_cast<int64_t>(2 * available_cores());
  if (S < kMinSequencesPerItemSplit && (D == 16 || D == 32 || D == 64 || D == 128) && S < want &&
      longest >= 2 * kMinChunkBlocks) {
    const int64_t per_seq = (want + S - 1) / S;
    step.chunk_blocks = std::max(kMinChunkBlocks, (longest + per_seq - 1) / per_seq);
    step.chunks_per_seq = (longest + step.chunk_blocks - 1) / step.chunk_blocks;
    thread_local std::vector<float> partial;
    partial.resize(static_cast<size_t>(S * step.chunks_per_seq * H * (D + 2)));
    step.partial = partial.data();
    step.heads_per_item = Hkv;
    RETURN_IF_ERROR(parallel_for(context, attend, static_cast<size_t>(S * step.chunks_per_seq), &step, false,
                                 std::min(static_cast<size_t>(S * step.chunks_per_seq), available_cores())));
    merge_chunks(step, S);
    return nullptr;
  }
#endif
  // one thread below ~64 KiB of keys and values (waking the pool costs more than it saves: the
  // rule of QuantizedLinear's batch 1)
  int64_t kv_bytes = 0;
  for (int64_t s = 0; s < S; ++s) kv_bytes += step.context_lens[s] * Hkv * D * 2 * static_cast<int64_t>(sizeof(float));
  return parallel_for(context, attend, static_cast<size_t>(S * Hkv / step.heads_per_item), &step,
                      kv_bytes < (64 << 10));
}

OrtStatus* create_kernel(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<Kernel>(kernel, [info](Kernel& k) { return float_attribute(info, "scale", &k.scale); });
}

}  // namespace

const OrtCustomOp* paged_decode_attention_op() {
  static const CustomOp op({"PagedDecodeAttention", kInputTypes, kNumInputs, 1, create_kernel});
  return &op;
}

}  // namespace trtllm_lite_kernels
