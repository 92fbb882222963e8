// Decode attention kernels over a paged KV cache, split across thread blocks (flash-decoding).
//
// One query token per sequence. Sequence s attends pool positions [0, context_lens[s] + 1)
// (its new K/V are written to the pool first). Shapes (elements fp16/bf16, metadata int64):
//   query  [num_seqs, num_heads, D]      out [num_seqs, num_heads, D]
//   pools  [num_blocks, block_size, num_kv_heads, D]
//   block_tables [num_seqs, max_blocks_per_seq]
//
// Pass 1, a split kernel: grid (num_splits, num_kv_heads * head_chunks, num_seqs), 128 threads.
// A thread block owns `chunk` consecutive positions of one sequence and the GM query heads of one
// KV group, so each K/V row is read from memory once for all heads of the group. D/8 lanes share
// one token row: each lane takes 16 bytes (8 elements) of K and of V, holds the matching 8 query
// elements of every head in registers, and the dot products are finished with a butterfly of
// warp shuffles. Each thread keeps an online softmax (running max m, sum l, fp32 accumulator)
// per head [Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022]; the U tokens a thread
// takes at a time share one rescale. The block then merges its lanes and warps and writes the
// final output (one split) or a normalized partial (o, m, l) for the split.
// Two ways to bring K/V in (same math, see DecodeState):
//   decode_split_pipelined_kernel (default): cp.async copies tiles of K/V into a 3-stage shared
//     memory ring, so the next two tiles are in flight while one is computed;
//   decode_split_registers_kernel: each thread loads its U rows of K and V straight into
//     registers with read-once 16-byte loads, then computes.
// Pass 2, decode_merge_kernel: grid (num_heads, num_seqs), D threads: out = sum_i w_i o_i / sum_i
// w_i with w_i = l_i * 2^(m_i - max m) (flash-decoding, Dao, Haziza, Massa & Sizov 2023).
//
// Scores use base-2 exponentials: q is pre-scaled by scale * log2(e).
#pragma once

#include <math.h>

#include "common.cuh"

namespace tl {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

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

// Which positions and heads a block owns.
struct DecodeWork {
  int seq, kvh, h0, ng;   // sequence, KV head, first query head, heads in use (<= GM)
  int t_begin, t_end;     // positions [t_begin, t_end) of this split
  __device__ bool init(const DecodeParams& p, int gm) {
    seq = blockIdx.z;
    kvh = blockIdx.y / p.head_chunks;
    const int hc = blockIdx.y - kvh * p.head_chunks;
    h0 = kvh * p.group + hc * gm;
    ng = min(gm, p.group - hc * gm);
    const int kv_len = static_cast<int>(p.context_lens[seq]) + 1;
    t_begin = blockIdx.x * p.chunk;
    // The last split takes any remainder, so an understated max_seq_len costs speed only.
    t_end = blockIdx.x + 1 == gridDim.x ? kv_len : min(kv_len, t_begin + p.chunk);
    return t_begin < kv_len;  // false: split past this sequence's end
  }
  // Pool element offset of position t's row for this KV head.
  __device__ int64_t row_offset(const DecodeParams& p, const int64_t* bt, int t, int d) const {
    const int64_t block = bt[t >> p.log2_block_size];
    const int64_t slot = (block << p.log2_block_size) + (t & ((1 << p.log2_block_size) - 1));
    return (slot * p.num_kv_heads + kvh) * d;
  }
};

// Per-thread decode state: GM heads' query slice, running max/sum and accumulator.
template <typename T, int D, int GM>
struct DecodeState {
  static constexpr int L = D / 8;   // lanes per token row
  static constexpr int R = 32 / L;  // token rows per warp
  float q[GM][8];
  float m[GM], l[GM], acc[GM][8];

  __device__ void init(const DecodeParams& p, const DecodeWork& w, int sub) {
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      if (g < w.ng) {
        const T* qp = static_cast<const T*>(p.query) +
                      (static_cast<int64_t>(w.seq) * p.num_heads + w.h0 + g) * D + sub * 8;
        unpack8<T>(ld_vec(qp), q[g]);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[g][i] *= p.scale_log2;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[g][i] = 0.f;
      }
      m[g] = kNegBig;
      l[g] = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
    }
  }

  // Attend U token rows: kr/vr hold this lane's 16 bytes of each row, valid[u] masks rows.
  template <int U>
  __device__ void consume(const Vec8 (&kr)[U], const Vec8 (&vr)[U], const bool (&valid)[U]) {
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
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!valid[u]) s[g][u] = -INFINITY;
        mx = fmaxf(mx, s[g][u]);
      }
      const float alpha = fast_exp2(m[g] - mx);
      m[g] = mx;
      l[g] *= alpha;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        s[g][u] = fast_exp2(s[g][u] - mx);
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

  // Merge lanes and warps through `red` (shared, >= kDecodeWarps * GM * (D + 2) floats, free to
  // overwrite after a barrier), then write the output or this split's partial.
  __device__ void finish(const DecodeParams& p, const DecodeWork& w, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane % L, row = lane / L;
#pragma unroll
    for (int o = L; o < 32; o <<= 1) {  // the R rows of a warp (lanes L, 2L, ... apart)
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
        const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
        const float mn = fmaxf(m[g], mo);
        const float a = fast_exp2(m[g] - mn), b = fast_exp2(mo - mn);
        l[g] = l[g] * a + lo * b;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
          acc[g][i] = acc[g][i] * a + ao * b;
        }
        m[g] = mn;
      }
    }
    float* red_o = red;                                   // [warps][GM][D]
    float* red_m = red + kDecodeWarps * GM * D;           // [warps][GM]
    float* red_l = red_m + kDecodeWarps * GM;             // [warps][GM]
    __syncthreads();  // `red` may alias buffers other warps were still reading
    if (row == 0) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) red_o[(warp * GM + g) * D + sub * 8 + i] = acc[g][i];
        if (sub == 0) {
          red_m[warp * GM + g] = m[g];
          red_l[warp * GM + g] = l[g];
        }
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < w.ng * D; e += kDecodeThreads) {
      const int g = e / D, d = e - g * D;
      float mx = kNegBig;
#pragma unroll
      for (int v = 0; v < kDecodeWarps; ++v) mx = fmaxf(mx, red_m[v * GM + g]);
      float sum = 0.f, o = 0.f;
#pragma unroll
      for (int v = 0; v < kDecodeWarps; ++v) {
        const float wgt = fast_exp2(red_m[v * GM + g] - mx);
        sum += red_l[v * GM + g] * wgt;
        o += red_o[(v * GM + g) * D + d] * wgt;
      }
      const int64_t head_row = static_cast<int64_t>(w.seq) * p.num_heads + w.h0 + g;
      if (p.num_splits == 1) {
        static_cast<T*>(p.out)[head_row * D + d] = Elem<T>::from_float(o / sum);
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
};

template <int GM>
__host__ __device__ constexpr int decode_red_floats(int d) { return kDecodeWarps * GM * (d + 2); }

// ---- variant 1: K/V rows straight into registers ----
template <int D, int GM>
struct RegisterShape {
  static constexpr int kUnroll = GM >= 8 ? 4 : 8;                       // rows per thread per tile
  static constexpr int kTile = kDecodeWarps * (32 / (D / 8)) * kUnroll;  // positions per tile
};

template <typename T, int D, int GM>
__global__ void __launch_bounds__(kDecodeThreads)
decode_split_registers_kernel(const DecodeParams p) {
  using State = DecodeState<T, D, GM>;
  constexpr int L = State::L, R = State::R, U = RegisterShape<D, GM>::kUnroll;
  constexpr int TILE = RegisterShape<D, GM>::kTile;
  __shared__ __align__(16) float red[decode_red_floats<GM>(D)];
  TL_EMU_POISON(red);
  DecodeWork w;
  if (!w.init(p, GM)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % L, row = lane / L;
  State st;
  st.init(p, w, sub);

  const int64_t* bt = p.block_tables + static_cast<int64_t>(w.seq) * p.max_blocks_per_seq;
  const T* kbase = static_cast<const T*>(p.key_cache) + sub * 8;
  const T* vbase = static_cast<const T*>(p.value_cache) + sub * 8;
  // Row offsets of the next tile are computed while the current tile's loads are in flight.
  int64_t off[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int t = w.t_begin + (warp * U + u) * R + row;
    off[u] = t < w.t_end ? w.row_offset(p, bt, t, D) : -1;
  }
  for (int tile0 = w.t_begin; tile0 < w.t_end; tile0 += TILE) {
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
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = tile0 + TILE + (warp * U + u) * R + row;
      off[u] = t < w.t_end ? w.row_offset(p, bt, t, D) : -1;
    }
    st.template consume<U>(kr, vr, valid);
  }
  st.finish(p, w, red);
}

// ---- variant 2 (default): cp.async into a 3-stage shared-memory ring ----
template <int D>
struct PipelineShape {
  static constexpr int kTile = 4096 / D;                 // positions per stage: 8 KB of K + 8 of V
  static constexpr int kStages = 3;                      // 48 KB of static shared memory
  static constexpr int kUnroll = kTile / kDecodeWarps / (32 / (D / 8));  // rows per thread
  static constexpr int kCopies = kTile * (D / 8) / kDecodeThreads;       // 16 B copies of K (and of V)
};

template <typename T, int D, int GM>
__global__ void __launch_bounds__(kDecodeThreads)
decode_split_pipelined_kernel(const DecodeParams p) {
  using State = DecodeState<T, D, GM>;
  using S = PipelineShape<D>;
  constexpr int L = State::L, R = State::R, U = S::kUnroll, TILE = S::kTile;
  constexpr int STAGES = S::kStages, COPIES = S::kCopies;
  static_assert(U * R * kDecodeWarps == TILE && COPIES * kDecodeThreads == TILE * L, "shape");
  static_assert(decode_red_floats<GM>(D) * 4 <= STAGES * 2 * TILE * D * 2, "red fits the ring");
  // ring[stage][0 = K, 1 = V][position in tile][D], element bits
  __shared__ __align__(16) uint16_t ring[STAGES][2][TILE * D];
  TL_EMU_POISON(ring);
  DecodeWork w;
  if (!w.init(p, GM)) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % L, row = lane / L;
  State st;
  st.init(p, w, sub);

  const int64_t* bt = p.block_tables + static_cast<int64_t>(w.seq) * p.max_blocks_per_seq;
  const T* kpool = static_cast<const T*>(p.key_cache);
  const T* vpool = static_cast<const T*>(p.value_cache);
  const int ntiles = (w.t_end - w.t_begin + TILE - 1) / TILE;
  // Copy i of a tile moves vector (c % L) of tile row c / L, c = tid + i * 128, for K and V.
  // Source offsets (block-table lookups) for a tile are computed one tile ahead of its copies,
  // so the lookups' latency overlaps the current tile's math.
  int64_t off[COPIES];  // -1: past the split's end (zero-fill)
  auto plan_tile = [&](int j) {
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
      const int c = tid + i * kDecodeThreads;
      const int t = w.t_begin + j * TILE + c / L;
      off[i] = t < w.t_end ? w.row_offset(p, bt, t, D) + (c % L) * 8 : -1;
    }
  };
  auto issue_tile = [&](int j) {
    const int stage = j % STAGES;
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
      const int c = tid + i * kDecodeThreads;
      const int dst = (c / L) * D + (c % L) * 8;
      const bool ok = off[i] >= 0;
      cp_async16(&ring[stage][0][dst], ok ? kpool + off[i] : kpool, ok);
      cp_async16(&ring[stage][1][dst], ok ? vpool + off[i] : vpool, ok);
    }
  };
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    plan_tile(j);
    if (j < ntiles) issue_tile(j);
    cp_async_commit();
  }
  plan_tile(STAGES - 1);
  for (int j = 0; j < ntiles; ++j) {
    cp_async_wait<STAGES - 2>();  // tile j has landed (for this thread's copies)
    __syncthreads();              // ... for every thread's; and tile j - 1 is consumed
    if (j + STAGES - 1 < ntiles) issue_tile(j + STAGES - 1);  // refills tile j - 1's stage
    cp_async_commit();
    plan_tile(j + STAGES);
    const uint16_t* ks = ring[j % STAGES][0];
    const uint16_t* vs = ring[j % STAGES][1];
    Vec8 kr[U], vr[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = (warp * U + u) * R + row;
      valid[u] = w.t_begin + j * TILE + r < w.t_end;
      kr[u] = *reinterpret_cast<const Vec8*>(ks + r * D + sub * 8);
      vr[u] = *reinterpret_cast<const Vec8*>(vs + r * D + sub * 8);
    }
    st.template consume<U>(kr, vr, valid);
  }
  cp_async_wait<0>();
  st.finish(p, w, reinterpret_cast<float*>(&ring[0][0][0]));
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
    const float w = ml[2 * i + 1] * fast_exp2(ml[2 * i] - mx);
    sum += w;
    o += po[static_cast<int64_t>(i) * D] * w;
  }
  out[head_row * D + d] = Elem<T>::from_float(o / sum);
}

}  // namespace tl
