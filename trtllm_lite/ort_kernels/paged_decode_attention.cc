// trtllm_lite::PagedDecodeAttention for ONNX Runtime's CPU execution provider.
//
// The PagedAttention op's decode step (every sequence computes one token), read straight from
// the paged KV pool: for each sequence (or, with few sequences, each (sequence, KV head) pair,
// so every thread has work) the kernel walks the sequence's blocks through its block table
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
  float scale;
};

// The pool rows of sequence s from KV head h on, block by block: fn(row pointer, first
// position, rows) for each of the sequence's context blocks, the next block prefetched.
template <typename Fn>
inline void for_each_block(const DecodeStep& st, int64_t s, int64_t h, const float* pool, int64_t ctx, Fn fn) {
  const int64_t bs = st.block_size, hkv = st.num_kv_heads, d = st.head_dim;
  const int64_t* table = st.block_tables + s * st.max_blocks;
  const int64_t block_floats = bs * hkv * d;
  for (int64_t start = 0; start < ctx; start += bs) {
    if (start + bs < ctx) {   // blocks lie anywhere in the pool: fetch the next one ahead
      const char* next = reinterpret_cast<const char*>(pool + table[start / bs + 1] * block_floats);
      for (int64_t line = 0; line < block_floats * 4; line += 64) __builtin_prefetch(next + line);
    }
    fn(pool + table[start / bs] * block_floats + h * d, start, std::min(bs, ctx - start));
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
  for_each_block(st, s, h, st.key_cache, ctx, [&](const float* k, int64_t first, int64_t rows) {
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
  for_each_block(st, s, h, st.value_cache, ctx, [&](const float* v, int64_t first, int64_t rows) {
    for (int64_t j = 0; j < rows; ++j) add_row(v + j * stride, first + j);
  });
  add_row(st.value + (s * hkv + h) * d, ctx);
  std::memcpy(st.output + (s * st.num_heads + h * group) * d, acc, sizeof(float) * group * d);
}

#ifdef __AVX512F__
// AVX-512 version for head_dim = 16 * NC: KV heads [h0, h0 + nh) of sequence s, each pool row
// read once for all of them (one contiguous nh * D stretch) and held in NC registers per head.
template <int NC>
void attend_avx512(const DecodeStep& st, int64_t s, int64_t h0, int64_t nh, float* scores, float* acc) {
  constexpr int64_t d = 16 * NC;
  const int64_t hkv = st.num_kv_heads, group = st.num_heads / hkv, rows = nh * group;
  const int64_t ctx = st.context_lens[s], n = ctx + 1, stride = hkv * d;
  const float* q = st.query + (s * st.num_heads + h0 * group) * d;   // [rows, D]
  float* q_scaled = acc;                        // [rows, D] scratch, reused for the sums below
  for (int64_t i = 0; i < rows * d; ++i) q_scaled[i] = q[i] * st.scale;

  auto score_row = [&](const float* k, int64_t pos) {   // k: head h0's row at pos
    for (int64_t hh = 0; hh < nh; ++hh) {
      __m512 kr[NC];
      for (int c = 0; c < NC; ++c) kr[c] = _mm512_loadu_ps(k + hh * d + 16 * c);
      for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
        const float* qg = q_scaled + g * d;
        __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), kr[0]);
        for (int c = 1; c < NC; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kr[c], dot);
        scores[g * n + pos] = _mm512_reduce_add_ps(dot);
      }
    }
  };
  for_each_block(st, s, h0, st.key_cache, ctx, [&](const float* k, int64_t first, int64_t len) {
    for (int64_t j = 0; j < len; ++j) score_row(k + j * stride, first + j);
  });
  score_row(st.key + (s * hkv + h0) * d, ctx);

  thread_local std::vector<float> inv_total;
  inv_total.resize(static_cast<size_t>(rows));
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
    inv_total[g] = 1.0f / _mm512_reduce_add_ps(total);
  }

  std::fill(acc, acc + rows * d, 0.0f);
  auto add_row = [&](const float* v, int64_t pos) {
    for (int64_t hh = 0; hh < nh; ++hh) {
      __m512 vr[NC];
      for (int c = 0; c < NC; ++c) vr[c] = _mm512_loadu_ps(v + hh * d + 16 * c);
      for (int64_t g = hh * group; g < (hh + 1) * group; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * n + pos]);
        float* a = acc + g * d;
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(p, vr[c], _mm512_loadu_ps(a + 16 * c)));
      }
    }
  };
  for_each_block(st, s, h0, st.value_cache, ctx, [&](const float* v, int64_t first, int64_t len) {
    for (int64_t j = 0; j < len; ++j) add_row(v + j * stride, first + j);
  });
  add_row(st.value + (s * hkv + h0) * d, ctx);
  float* out = st.output + (s * st.num_heads + h0 * group) * d;
  for (int64_t g = 0; g < rows; ++g) {
    const __m512 inv = _mm512_set1_ps(inv_total[g]);
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(out + g * d + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + 16 * c), inv));
  }
}
#endif

// One work item: KV heads [h0, h0 + heads_per_item) of one sequence (all their query heads).
void attend(void* user, size_t item) {
  const DecodeStep& st = *static_cast<const DecodeStep*>(user);
  const int64_t hkv = st.num_kv_heads, group = st.num_heads / hkv, nh = st.heads_per_item;
  const int64_t items_per_seq = hkv / nh;
  const int64_t s = static_cast<int64_t>(item) / items_per_seq, h0 = static_cast<int64_t>(item) % items_per_seq * nh;
  const int64_t n = st.context_lens[s] + 1;
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(nh * group * (n + st.head_dim)));
  float* scores = buffer.data();              // [nh * G, n]
  float* acc = scores + nh * group * n;       // [nh * G, D]
#ifdef __AVX512F__
  switch (st.head_dim) {
    case 16: return attend_avx512<1>(st, s, h0, nh, scores, acc);
    case 32: return attend_avx512<2>(st, s, h0, nh, scores, acc);
    case 64: return attend_avx512<4>(st, s, h0, nh, scores, acc);
    case 128: return attend_avx512<8>(st, s, h0, nh, scores, acc);
    default: break;
  }
#endif
  for (int64_t h = h0; h < h0 + nh; ++h) attend_portable(st, s, h, scores, acc);
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
  return parallel_for(context, attend, static_cast<size_t>(S * Hkv / step.heads_per_item), &step);
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
