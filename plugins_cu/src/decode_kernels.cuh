// Decode attention kernels over a paged KV cache, split across thread blocks (flash-decoding).
//
// One query token per sequence. Sequence s attends pool positions [0, context_lens[s] + 1)
// (its new K/V are written to the pool first). Shapes (elements fp16/bf16, metadata int64):
//   query  [num_seqs, num_heads, D]      out [num_seqs, num_heads, D]
//   pools  [num_blocks, block_size, num_kv_heads, D]
//   block_tables [num_seqs, max_blocks_per_seq]
//
// Pass 1, a split kernel: grid (num_splits, num_kv_heads * head_chunks, num_seqs), 128 threads.
// A thread block owns `chunk` consecutive positions of one sequence and GM query heads of one KV
// group, so each K/V row is read from memory once for all heads of the group. Each keeps an
// online softmax (running max m, sum l, fp32 accumulator) per head [Milakov & Gimelshein 2018;
// FlashAttention, Dao et al. 2022], then merges its warps and writes the final output (one
// split) or a normalized partial (o, m, l) for the split. Three kernels, same results:
//   decode_split_mma_kernel (default): tensor cores, the group's heads as the MMA rows, K/V
//     fragments loaded straight from the pool (see its comment);
//   decode_split_pipelined_kernel: CUDA cores; D/8 lanes share one token row, each takes 16
//     bytes (8 elements) of K and of V and holds the matching 8 query elements of every head,
//     dot products end with a butterfly of warp shuffles, the U rows a thread takes at a time
//     share one rescale; cp.async copies tiles of K/V into a 3-stage shared-memory ring;
//   decode_split_registers_kernel: the same math with each thread's U rows of K and V loaded
//     straight into registers with read-once 16-byte loads.
// On an H200 the MMA kernel is 0.93-1.29x (median 1.06x) the faster CUDA-core kernel over the
// benchmark's sizes (docs/benchmarks.md): those issue ~GM * D / 4 FMAs and shuffles per thread
// per row, the MMA kernel a fixed amount of work per K/V byte.
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

// Cross-warp merge through shared memory `red` (decode_red_floats<GM>(D) floats):
//   red[warp][GM][D] normalized-later accumulators, then max m and sum l per (warp, head).
template <int GM, int D>
__device__ __forceinline__ void store_warp_stats(float* red, int warp, int g, float m, float l) {
  float* red_m = red + kDecodeWarps * GM * D;
  red_m[warp * GM + g] = m;
  red_m[kDecodeWarps * GM + warp * GM + g] = l;
}

// After a barrier: out (one split) or this split's normalized partial (o, m, l) for the block's
// w.ng heads, from the kDecodeWarps warps' (acc, m, l) in `red`.
template <typename T, int D, int GM>
__device__ __forceinline__ void merge_warps_and_store(const DecodeParams& p, const DecodeWork& w,
                                                      const float* red) {
  const float* red_o = red;                          // [warps][GM][D]
  const float* red_m = red + kDecodeWarps * GM * D;  // [warps][GM]
  const float* red_l = red_m + kDecodeWarps * GM;    // [warps][GM]
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
    __syncthreads();  // `red` may alias buffers other warps were still reading
    if (row == 0) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int i = 0; i < 8; ++i) red[(warp * GM + g) * D + sub * 8 + i] = acc[g][i];
        if (sub == 0) store_warp_stats<GM, D>(red, warp, g, m[g], l[g]);
      }
    }
    __syncthreads();
    merge_warps_and_store<T, D, GM>(p, w, red);
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

// ---- variant 2: cp.async into a 3-stage shared-memory ring ----
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

// ---- variant 3 (default): tensor cores, K/V fragments loaded straight from the pool ----
// mma.m16n8k16 with the KV group's query heads as the rows (kMmaHeads = 8 per block; rows 8-15
// stay zero), so the instructions per K/V byte do not grow with the group size: per 16 positions
// a warp issues D / 8 MMAs for S = Q K^T and D / 8 for O += P V, against ~GM * D / 4 FMAs and
// shuffles per thread in variants 1 and 2. Warp w takes positions [t0, t0 + 16) for
// t0 = t_begin + 16 w, + 64, ...; each warp keeps its own (m, l, O) and the block merges them.
// No shared-memory staging: the head dim and the positions are ordered (the same way for both
// operands of each product, so the sums are unchanged) such that every load is a contiguous
// 16-byte vector (PTX ISA fragment layouts, common.cuh; g = lane / 4, t = lane % 4):
//   S: k-steps 2j and 2j+1 cover dims [32j, 32j + 32). Lane (g, t) loads the 16 bytes at dim
//      32j + 8t of K row 8 nt + g (n-tile nt = 0, 1) and of Q head g; words 0 and 1 are k-step
//      2j's (k 2t..2t+1 and 2t+8..2t+9), words 2 and 3 k-step 2j+1's.
//   O: one k-step over the 16 positions. The S accumulator columns a lane holds, 2t and 2t+1 of
//      each n-tile, are positions 2t, 2t+1 (b0) and 8+2t, 9+2t (b1); column g of d-tile dt is
//      dim 64 (dt / 8) + 8 g + dt % 8. So the lane loads 16 bytes at dim 64 c + 8 g of each of
//      its 4 rows (c < D / 64) and pairs two rows' elements per 32-bit word with byte permutes.
// Each warp has 8 KB (D = 128) of loads in flight per step of 16 positions.
constexpr int kMmaHeads = 8;

// Word of a B fragment from two K/V rows: element `hi` of word w0 (row k) and of w1 (row k+1).
__device__ __forceinline__ uint32_t pair_rows(uint32_t w0, uint32_t w1, bool hi) {
  return hi ? (w0 >> 16) | (w1 & 0xffff0000u) : (w0 & 0xffffu) | (w1 << 16);
}

// PREFETCH (template parameter, chosen by the decode policy): load a warp's next 16 positions
// while it computes these (double-buffered registers: twice the bytes in flight per warp). On
// an H200 it pays at D = 128 (~245 registers, still 2 blocks per SM: 0-10% faster at batch x
// context >= 16 x 4k, 8-10% in 5 of those 6 cells) and costs at D = 64 (132 registers: 4 -> 3 blocks per SM), so the default
// is on for D = 128 only (docs/benchmarks.md). Staging K/V through a lane-private cp.async ring
// in shared memory instead (2-4 stages) measured slower than both: the ring's shared memory
// cut the resident blocks.
template <typename T, int D>
struct MmaDecodeStep {
  static constexpr int KJ = D / 32;  // 16-byte vectors of a K row per lane
  static constexpr int VC = D / 64;  // 16-byte vectors of a V row per lane
  static constexpr int DT = D / 8;   // d-tiles of O
  Vec8 k[2][KJ], v[4][VC];           // K rows 8 nt + g; V rows 2t, 2t+1, 2t+8, 2t+9 (from t0)

  // This lane's pieces of the 16 positions from t0 (zeros past the split's end); kpool / vpool
  // are offset by the lane's 8t / 8g elements.
  __device__ __forceinline__ void fetch(const DecodeParams& p, const DecodeWork& w,
                                        const int64_t* bt, const T* kpool, const T* vpool,
                                        int t0, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int pos = t0 + 8 * nt + g;
      const bool ok = pos < w.t_end;
      const T* src = kpool + (ok ? w.row_offset(p, bt, pos, D) : 0);
#pragma unroll
      for (int j = 0; j < KJ; ++j) k[nt][j] = ok ? ld_stream(src + 32 * j) : Vec8{};
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int pos = t0 + 8 * (r >> 1) + 2 * t + (r & 1);
      const bool ok = pos < w.t_end;
      const T* src = vpool + (ok ? w.row_offset(p, bt, pos, D) : 0);
#pragma unroll
      for (int c = 0; c < VC; ++c) v[r][c] = ok ? ld_stream(src + 64 * c) : Vec8{};
    }
  }

  // Online softmax update of head g (running max m, this lane's partial sum l, O accumulator)
  // with the 16 positions from t0.
  __device__ __forceinline__ void attend(const DecodeParams& p, const DecodeWork& w,
                                         const Vec8 (&q)[KJ], int t0, int t, float& m, float& l,
                                         float (&o)[DT][4]) const {
    // S = Q K^T: rows g (heads), columns 2t, 2t+1 of n-tile nt (positions 8nt + 2t + e).
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int j = 0; j < KJ; ++j) {
        const uint32_t a0[4] = {q[j].w[0], 0u, q[j].w[1], 0u};
        const uint32_t a1[4] = {q[j].w[2], 0u, q[j].w[3], 0u};
        Mma<T>::run(s[nt], a0, k[nt][j].w[0], k[nt][j].w[1]);
        Mma<T>::run(s[nt], a1, k[nt][j].w[2], k[nt][j].w[3]);
      }
    }
    // 4 of the 16 scores here, 12 in the quad's other lanes.
    float mx = m;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int pos = t0 + 8 * nt + 2 * t + e;
        s[nt][e] = pos < w.t_end ? s[nt][e] * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[nt][e]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float alpha = fast_exp2(m - mx);
    m = mx;
    l *= alpha;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= alpha;
      o[dt][1] *= alpha;
    }
    float pr[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        pr[nt][e] = fast_exp2(s[nt][e] - m);
        l += pr[nt][e];
      }
    }
    const uint32_t pa[4] = {Elem<T>::pack(pr[0][0], pr[0][1]), 0u,
                            Elem<T>::pack(pr[1][0], pr[1][1]), 0u};
    // O += P V over d-tiles dt = 8c + e: column g is dim 64c + 8g + e.
#pragma unroll
    for (int c = 0; c < VC; ++c) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int kw = e >> 1;
        const bool hi = e & 1;
        Mma<T>::run(o[8 * c + e], pa, pair_rows(v[0][c].w[kw], v[1][c].w[kw], hi),
                    pair_rows(v[2][c].w[kw], v[3][c].w[kw], hi));
      }
    }
  }
};

template <typename T, int D, bool PREFETCH>
__global__ void __launch_bounds__(kDecodeThreads)
decode_split_mma_kernel(const DecodeParams p) {
  using Step = MmaDecodeStep<T, D>;
  constexpr int GM = kMmaHeads, KJ = Step::KJ, DT = Step::DT;
  constexpr int STRIDE = 16 * kDecodeWarps;  // positions between a warp's steps
  __shared__ __align__(16) float red[decode_red_floats<GM>(D)];
  TL_EMU_POISON(red);
  DecodeWork w;
  if (!w.init(p, GM)) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;

  Vec8 q[KJ];  // head g's dims [32j + 8t, +8): A-fragment words (zero for heads past ng)
  {
    const T* qp = static_cast<const T*>(p.query) +
                  (static_cast<int64_t>(w.seq) * p.num_heads + w.h0 + (g < w.ng ? g : 0)) * D +
                  8 * t;
#pragma unroll
    for (int j = 0; j < KJ; ++j) {
      q[j] = ld_vec(qp + 32 * j);
      if (g >= w.ng) q[j].w[0] = q[j].w[1] = q[j].w[2] = q[j].w[3] = 0u;
    }
  }
  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m = kNegBig, l = 0.f;  // head g's running max (base 2) and this lane's partial sum

  const int64_t* bt = p.block_tables + static_cast<int64_t>(w.seq) * p.max_blocks_per_seq;
  const T* kpool = static_cast<const T*>(p.key_cache) + 8 * t;
  const T* vpool = static_cast<const T*>(p.value_cache) + 8 * g;
  const int first = w.t_begin + 16 * warp;
  if constexpr (PREFETCH) {
    Step cur;
    if (first < w.t_end) cur.fetch(p, w, bt, kpool, vpool, first, g, t);
    for (int t0 = first; t0 < w.t_end; t0 += STRIDE) {
      Step next;
      if (t0 + STRIDE < w.t_end) next.fetch(p, w, bt, kpool, vpool, t0 + STRIDE, g, t);
      cur.attend(p, w, q, t0, t, m, l, o);
      cur = next;
    }
  } else {
    for (int t0 = first; t0 < w.t_end; t0 += STRIDE) {
      Step cur;
      cur.fetch(p, w, bt, kpool, vpool, t0, g, t);
      cur.attend(p, w, q, t0, t, m, l, o);
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  // Lane (g, t) holds head g's dims 64c + 16t + e (o[8c + e][0]) and 64c + 16t + 8 + e ([1]).
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    const int d = 64 * (dt >> 3) + 16 * t + (dt & 7);
    red[(warp * GM + g) * D + d] = o[dt][0];
    red[(warp * GM + g) * D + d + 8] = o[dt][1];
  }
  if (t == 0) store_warp_stats<GM, D>(red, warp, g, m, l);
  __syncthreads();
  merge_warps_and_store<T, D, GM>(p, w, red);
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
