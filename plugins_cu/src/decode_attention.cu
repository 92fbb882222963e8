// Decode attention over a paged KV cache, split across thread blocks (flash-decoding).
//
// One query token per sequence. Sequence s attends pool positions [0, context_lens[s] + 1)
// (its new K/V are written to the pool first). Shapes (elements fp16/bf16, metadata int64):
//   query  [num_seqs, num_heads, D]      out [num_seqs, num_heads, D]
//   pools  [num_blocks, block_size, num_kv_heads, D]
//   block_tables [num_seqs, max_blocks_per_seq]
//
// Pass 1, decode_split_kernel: grid (num_splits, num_kv_heads * head_chunks, num_seqs), 128
// threads. A thread block owns `chunk` consecutive positions of one sequence and the GM query
// heads of one KV group, so each K/V row is read from memory once for all heads of the group.
// D/8 lanes share one token row: each lane loads 16 bytes (8 elements) of K and of V with a
// read-once load, holds the matching 8 query elements of every head in registers, and the dot
// products are finished with a butterfly of warp shuffles. Each thread keeps an online softmax
// (running max m, sum l, fp32 accumulator) per head [Milakov & Gimelshein 2018; FlashAttention,
// Dao et al. 2022]; a tile of U tokens per thread shares one rescale. The block then merges its
// lanes and warps and writes either the final output (one split) or a normalized partial
// (o, m, l) per split.
// Pass 2, decode_merge_kernel: grid (num_heads, num_seqs), D threads: out = sum_i w_i o_i / sum_i
// w_i with w_i = l_i * 2^(m_i - max m) (flash-decoding, Dao, Haziza, Massa & Sizov 2023).
//
// Scores use base-2 exponentials: q is pre-scaled by scale * log2(e).
#include <math.h>

#include "common.cuh"
#include "launch.h"

namespace tl {

namespace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kChunkAlign = 128;  // split sizes are multiples of the largest tile

struct DecodeParams {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  void* out;                  // final output when num_splits == 1
  float* part_o;              // [num_seqs, num_heads, num_splits, D] normalized partial outputs
  float* part_ml;             // [num_seqs, num_heads, num_splits, 2] (max, sum) in base 2
  const int64_t* block_tables;
  const int64_t* context_lens;
  int num_heads, num_kv_heads, group, head_chunks;
  int log2_block_size, max_blocks_per_seq;
  int chunk, num_splits;
  float scale_log2;
};

template <int D, int GM>
struct DecodeShape {
  static constexpr int kLanes = D / 8;              // lanes per token row (16 B each)
  static constexpr int kRows = 32 / kLanes;         // token rows per warp load
  static constexpr int kUnroll = GM >= 8 ? 4 : 8;   // tokens per thread per tile
  static constexpr int kTile = kDecodeWarps * kRows * kUnroll;  // tokens per block per tile
};

template <typename T, int D, int GM>
__global__ void __launch_bounds__(kDecodeThreads)
decode_split_kernel(const DecodeParams p) {
  using S = DecodeShape<D, GM>;
  constexpr int L = S::kLanes, R = S::kRows, U = S::kUnroll, TILE = S::kTile;
  __shared__ float red_o[kDecodeWarps][GM][D];
  __shared__ float red_m[kDecodeWarps][GM];
  __shared__ float red_l[kDecodeWarps][GM];
  TL_EMU_POISON(red_o);
  TL_EMU_POISON(red_m);
  TL_EMU_POISON(red_l);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % L, row = lane / L;
  const int seq = blockIdx.z;
  const int kvh = blockIdx.y / p.head_chunks;
  const int hc = blockIdx.y - kvh * p.head_chunks;
  const int h0 = kvh * p.group + hc * GM;              // first query head of this block
  const int ng = min(GM, p.group - hc * GM);           // heads in use (<= GM)
  const int kv_len = static_cast<int>(p.context_lens[seq]) + 1;
  const int t_begin = blockIdx.x * p.chunk;
  if (t_begin >= kv_len) return;                       // split past this sequence's end
  const int t_end = min(kv_len, t_begin + p.chunk);

  // Query slice of every head, pre-scaled for exp2.
  float q[GM][8];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g < ng) {
      const T* qp = static_cast<const T*>(p.query) +
                    (static_cast<int64_t>(seq) * p.num_heads + h0 + g) * D + sub * 8;
      unpack8<T>(ld_vec(qp), q[g]);
#pragma unroll
      for (int i = 0; i < 8; ++i) q[g][i] *= p.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) q[g][i] = 0.f;
    }
  }

  float m[GM], l[GM], acc[GM][8];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = kNegBig;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  }

  const int64_t* bt = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;  // elements per slot
  const T* kbase = static_cast<const T*>(p.key_cache) + kvh * D + sub * 8;
  const T* vbase = static_cast<const T*>(p.value_cache) + kvh * D + sub * 8;
  const int bs_mask = (1 << p.log2_block_size) - 1;

  // Element offset of this thread's 16 bytes for token u of a tile (-1: past the split's end).
  // Offsets for the next tile are computed while the current tile's loads are in flight.
  int64_t off[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = t_begin + (warp * U + u) * R + row;
    off[u] = t < t_end ? ((bt[t >> p.log2_block_size] << p.log2_block_size) + (t & bs_mask)) *
                             slot_elems
                       : -1;
  }

  for (int tile0 = t_begin; tile0 < t_end; tile0 += TILE) {
    Vec8 kr[U], vr[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      valid[u] = off[u] >= 0;
      if (valid[u]) {
        kr[u] = ld_stream(kbase + off[u]);
        vr[u] = ld_stream(vbase + off[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) kr[u].w[i] = vr[u].w[i] = 0u;
      }
    }
    const int next0 = tile0 + TILE;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = next0 + (warp * U + u) * R + row;
      off[u] = t < t_end ? ((bt[t >> p.log2_block_size] << p.log2_block_size) + (t & bs_mask)) *
                               slot_elems
                         : -1;
    }

    // Scores s[g][u] = q_g . k_u (base-2 logits): partial over 8 elements, then over L lanes.
    float s[GM][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      unpack8<T>(kr[u], kf);
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) a = fmaf(q[g][i], kf[i], a);
        s[g][u] = a;
      }
    }
#pragma unroll
    for (int o = L / 2; o >= 1; o >>= 1) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int g = 0; g < GM; ++g) s[g][u] += __shfl_xor_sync(0xffffffffu, s[g][u], o);
      }
    }

    // Online softmax: one rescale per tile, then p = 2^(s - m).
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!valid[u]) s[g][u] = -INFINITY;
        mx = fmaxf(mx, s[g][u]);
      }
      const float alpha = exp2f(m[g] - mx);
      m[g] = mx;
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        s[g][u] = exp2f(s[g][u] - mx);
        l[g] += s[g][u];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      unpack8<T>(vr[u], vf);
#pragma unroll
      for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(s[g][u], vf[i], acc[g][i]);
      }
    }
  }

  // Merge the R token rows of the warp (lanes that differ by multiples of L).
#pragma unroll
  for (int o = L; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float mn = fmaxf(m[g], mo);
      const float a = exp2f(m[g] - mn), b = exp2f(mo - mn);
      l[g] = l[g] * a + lo * b;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
        acc[g][i] = acc[g][i] * a + ao * b;
      }
      m[g] = mn;
    }
  }
  if (row == 0) {
#pragma unroll
    for (int g = 0; g < GM; ++g) {
#pragma unroll
      for (int i = 0; i < 8; ++i) red_o[warp][g][sub * 8 + i] = acc[g][i];
      if (sub == 0) {
        red_m[warp][g] = m[g];
        red_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  // Merge the warps; write the output (one split) or this split's normalized partial.
  for (int e = threadIdx.x; e < ng * D; e += kDecodeThreads) {
    const int g = e / D, d = e - g * D;
    float mx = kNegBig;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) mx = fmaxf(mx, red_m[w][g]);
    float sum = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float wgt = exp2f(red_m[w][g] - mx);
      sum += red_l[w][g] * wgt;
      o += red_o[w][g][d] * wgt;
    }
    const int64_t head_row = static_cast<int64_t>(seq) * p.num_heads + h0 + g;
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + head_row * D + d;
      *out = Elem<T>::from_float(o / sum);
    } else {
      const int64_t part = head_row * p.num_splits + blockIdx.x;
      p.part_o[part * D + d] = o / sum;
      if (d == 0) {
        p.part_ml[2 * part] = mx;
        p.part_ml[2 * part + 1] = sum;
      }
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(D)
decode_merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                    const int64_t* __restrict__ context_lens, T* __restrict__ out, int num_heads,
                    int num_splits, int chunk) {
  const int h = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int kv_len = static_cast<int>(context_lens[seq]) + 1;
  const int n = min(num_splits, (kv_len + chunk - 1) / chunk);  // splits that ran
  const int64_t head_row = static_cast<int64_t>(seq) * num_heads + h;
  const float* ml = part_ml + 2 * head_row * num_splits;
  float mx = kNegBig;
  for (int i = 0; i < n; ++i) mx = fmaxf(mx, ml[2 * i]);
  float sum = 0.f, o = 0.f;
  const float* po = part_o + head_row * num_splits * D + d;
  for (int i = 0; i < n; ++i) {
    const float w = ml[2 * i + 1] * exp2f(ml[2 * i] - mx);
    sum += w;
    o += po[static_cast<int64_t>(i) * D] * w;
  }
  out[head_row * D + d] = Elem<T>::from_float(o / sum);
}

struct Policy {
  int min_chunk = 256;
  int ctas_per_sm = 8;
};
Policy g_policy;

int heads_per_cta(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

template <typename T, int D, int GM>
int launch_split(const DecodeParams& prm, dim3 grid, cudaStream_t stream) {
  auto* kernel = decode_split_kernel<T, D, GM>;
  TL_LAUNCH(kernel, grid, kDecodeThreads, 0, stream, prm);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int D>
int launch_typed(const DecodeParams& prm, const DecodePlan& plan, int num_seqs,
                 cudaStream_t stream) {
  const dim3 grid(plan.num_splits, prm.num_kv_heads * prm.head_chunks, num_seqs);
  int err = 0;
  switch (plan.heads_per_cta) {
    case 1: err = launch_split<T, D, 1>(prm, grid, stream); break;
    case 2: err = launch_split<T, D, 2>(prm, grid, stream); break;
    case 4: err = launch_split<T, D, 4>(prm, grid, stream); break;
    default: err = launch_split<T, D, 8>(prm, grid, stream); break;
  }
  if (err || plan.num_splits == 1) return err;
  auto* merge = decode_merge_kernel<T, D>;
  TL_LAUNCH(merge, dim3(prm.num_heads, num_seqs), D, 0, stream, prm.part_o, prm.part_ml,
            prm.context_lens, static_cast<T*>(prm.out), prm.num_heads, plan.num_splits,
            plan.chunk);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

void set_decode_policy(int min_chunk, int ctas_per_sm) {
  g_policy.min_chunk = min_chunk > 0 ? min_chunk : Policy().min_chunk;
  g_policy.ctas_per_sm = ctas_per_sm > 0 ? ctas_per_sm : Policy().ctas_per_sm;
}

DecodePlan plan_decode(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                       int max_seq_len) {
  DecodePlan plan{};
  const int group = num_heads / num_kv_heads;
  plan.heads_per_cta = heads_per_cta(group);
  const int head_chunks = (group + plan.heads_per_cta - 1) / plan.heads_per_cta;
  const int64_t blocks = static_cast<int64_t>(num_seqs) * num_kv_heads * head_chunks;
  const int64_t target = static_cast<int64_t>(sm_count()) * g_policy.ctas_per_sm;
  const int64_t want = (target + blocks - 1) / blocks;  // splits per sequence wanted
  max_seq_len = max_seq_len > 1 ? max_seq_len : 1;
  if (want <= 1) {
    plan.chunk = max_seq_len;
    plan.num_splits = 1;
  } else {
    int chunk = static_cast<int>((max_seq_len + want - 1) / want);
    chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    chunk = chunk > g_policy.min_chunk ? chunk : g_policy.min_chunk;
    plan.chunk = chunk;
    plan.num_splits = (max_seq_len + chunk - 1) / chunk;
    if (plan.num_splits == 1) plan.chunk = max_seq_len;
  }
  plan.workspace_bytes =
      plan.num_splits == 1
          ? 0
          : static_cast<size_t>(num_seqs) * num_heads * plan.num_splits * (head_dim + 2) *
                sizeof(float);
  return plan;
}

int launch_decode(bool bf16, const void* query, const void* key_cache, const void* value_cache,
                  void* out, const int64_t* block_tables, const int64_t* context_lens,
                  int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                  int max_blocks_per_seq, int max_seq_len, float scale, void* workspace,
                  size_t workspace_size, cudaStream_t stream) {
  if (num_seqs <= 0) return 0;
  const DecodePlan plan = plan_decode(num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len);
  if (plan.workspace_bytes > 0 && (workspace == nullptr || workspace_size < plan.workspace_bytes))
    return TL_ERR_WORKSPACE;
  DecodeParams prm{};
  prm.query = query;
  prm.key_cache = key_cache;
  prm.value_cache = value_cache;
  prm.out = out;
  prm.part_o = static_cast<float*>(workspace);
  prm.part_ml = plan.workspace_bytes
                    ? prm.part_o + static_cast<size_t>(num_seqs) * num_heads * plan.num_splits *
                                       head_dim
                    : nullptr;
  prm.block_tables = block_tables;
  prm.context_lens = context_lens;
  prm.num_heads = num_heads;
  prm.num_kv_heads = num_kv_heads;
  prm.group = num_heads / num_kv_heads;
  prm.head_chunks = (prm.group + plan.heads_per_cta - 1) / plan.heads_per_cta;
  prm.log2_block_size = ilog2(block_size);
  prm.max_blocks_per_seq = max_blocks_per_seq;
  prm.chunk = plan.chunk;
  prm.num_splits = plan.num_splits;
  prm.scale_log2 = scale * kLog2e;
  if (num_seqs > 65535 || prm.num_kv_heads * prm.head_chunks > 65535) return TL_ERR_SHAPE;
  if (bf16) {
    return head_dim == 64 ? launch_typed<__nv_bfloat16, 64>(prm, plan, num_seqs, stream)
                          : launch_typed<__nv_bfloat16, 128>(prm, plan, num_seqs, stream);
  }
  return head_dim == 64 ? launch_typed<__half, 64>(prm, plan, num_seqs, stream)
                        : launch_typed<__half, 128>(prm, plan, num_seqs, stream);
}

}  // namespace tl
