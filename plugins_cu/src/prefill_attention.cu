// Prefill / chunked-prefill attention over a paged KV cache, FlashAttention-2 style on tensor
// cores [FlashAttention, Dao et al. 2022; FlashAttention-2, Dao 2023].
//
// Token j of sequence s (j = t - query_start_loc[s]) attends pool positions [0, ctx_s + j]
// (ctx_s = context_lens[s]): the cached context plus the chunk's own tokens up to itself; the
// chunk's K/V are written to the pool before this kernel runs. Shapes (fp16/bf16, int64 metadata):
//   query, out [num_tokens, num_heads, D]; pools [num_blocks, block_size, num_kv_heads, D]
//
// Work split: grid (row tiles, num_kv_heads, num_seqs), 128 threads = 4 warps. The rows of a
// (sequence, KV head) are the pairs (token j, head h of the group), r = j * group + h, so the
// query heads of a GQA group share every K/V tile. A block owns BM = 64 rows (16 per warp) and
// walks the key positions in tiles of BN = 64:
//   K tile, V tile: gathered through the block table into shared memory with cp.async (16 B per
//   copy, rows padded by 16 B so fragment reads are bank-conflict free); V(i) loads while
//   S = Q K(i)^T is computed, K(i+1) while O += P V(i).
//   S = Q K^T and O += P V: mma.m16n8k16, fp16/bf16 inputs, fp32 accumulators; Q stays in
//   registers as A fragments; P is re-packed from the S accumulators into A fragments.
//   Online softmax per row (base-2, scale * log2(e) folded in): running max and sum, the output
//   accumulator rescaled once per tile; the score matrix is never stored.
#include <math.h>

#include "common.cuh"
#include "launch.h"

namespace tl {

namespace {

constexpr int kPrefillThreads = 128;
constexpr int kBM = 64;  // rows (token, head) per block
constexpr int kBN = 64;  // key positions per tile

struct PrefillParams {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  void* out;
  const int64_t* block_tables;
  const int64_t* context_lens;
  const int64_t* query_start_loc;
  int num_heads, num_kv_heads, group;
  int log2_block_size, max_blocks_per_seq;
  float scale_log2;
};

// One block's work on rows [row0, row0 + 64) of (sequence seq, KV head kvh); `rows` =
// query length x group, `ctx` = cached positions before the chunk. Ks, Vs: shared tiles.
template <typename T, int D>
__device__ __forceinline__ void prefill_row_tile(const PrefillParams& p, int seq, int kvh,
                                                 int q_start, int rows, int ctx, int row0,
                                                 uint16_t* Ks, uint16_t* Vs) {
  constexpr int LDS = D + 8;                  // shared row stride, elements (16 B padding)
  constexpr int KSTEPS = D / 16;              // MMA k-steps over the head dim
  constexpr int NT = kBN / 8;                 // n-tiles of S per warp
  constexpr int DT = D / 8;                   // n-tiles of O per warp
  constexpr int VECS = D / 8;                 // 16-byte vectors per K/V row
  constexpr int CHUNKS = kBN * VECS / kPrefillThreads;  // cp.async copies per thread per tile
  static_assert(CHUNKS * kPrefillThreads == kBN * VECS, "tile copy must divide evenly");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int group = p.group;
  const int kv_end = ctx + (min(rows, row0 + kBM) - 1) / group + 1;  // positions this block needs

  // This thread's two rows: rA (fragment row g) and rB (g + 8) of the warp's 16.
  const int rA = row0 + warp * 16 + g, rB = rA + 8;
  const bool okA = rA < rows, okB = rB < rows;
  const int jA = okA ? rA / group : 0, jB = okB ? rB / group : 0;
  const int hA = okA ? rA - jA * group : 0, hB = okB ? rB - jB * group : 0;
  const int lastA = ctx + jA, lastB = ctx + jB;  // last visible position of each row
  const int64_t headA = static_cast<int64_t>(q_start + jA) * p.num_heads + kvh * group + hA;
  const int64_t headB = static_cast<int64_t>(q_start + jB) * p.num_heads + kvh * group + hB;

  // Q as A fragments (32-bit words = element pairs), zeros for rows past the end.
  uint32_t qa[KSTEPS][4];
  {
    const uint32_t* qA = reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.query) + headA * D);
    const uint32_t* qB = reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.query) + headB * D);
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      qa[ks][0] = okA ? qA[ks * 8 + t4] : 0u;
      qa[ks][1] = okB ? qB[ks * 8 + t4] : 0u;
      qa[ks][2] = okA ? qA[ks * 8 + 4 + t4] : 0u;
      qa[ks][3] = okB ? qB[ks * 8 + 4 + t4] : 0u;
    }
  }

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float mA = kNegBig, mB = kNegBig, lA = 0.f, lB = 0.f;

  const int64_t* bt = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * D;
  const int bs_mask = (1 << p.log2_block_size) - 1;
  const T* kpool = static_cast<const T*>(p.key_cache);
  const T* vpool = static_cast<const T*>(p.value_cache);

  // Copy c = tid + i * 128 of a tile moves vector (c % VECS) of tile row c / VECS.
  int64_t goff[CHUNKS];  // pool element offset of each copy's source (-1: zero-fill)
  auto plan_tile = [&](int kt) {
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = tid + i * kPrefillThreads;
      const int pos = kt * kBN + c / VECS;
      goff[i] = pos < kv_end
                    ? ((bt[pos >> p.log2_block_size] << p.log2_block_size) + (pos & bs_mask)) *
                              slot_elems +
                          kvh * D + (c % VECS) * 8
                    : -1;
    }
  };
  auto issue_tile = [&](uint16_t* dst, const T* pool) {
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      const int c = tid + i * kPrefillThreads;
      cp_async16(dst + (c / VECS) * LDS + (c % VECS) * 8, goff[i] >= 0 ? pool + goff[i] : pool,
                 goff[i] >= 0);
    }
  };

  const int ntiles = (kv_end + kBN - 1) / kBN;
  plan_tile(0);
  issue_tile(Ks, kpool);
  cp_async_commit();

  for (int kt = 0; kt < ntiles; ++kt) {
    issue_tile(Vs, vpool);  // V(kt): same positions as K(kt)
    cp_async_commit();
    cp_async_wait<1>();     // K(kt) has landed
    __syncthreads();

    // S = Q K^T for this warp's 16 rows x 64 positions.
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const uint16_t* krow = Ks + (nt * 8 + g) * LDS + 2 * t4;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(krow + ks * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(krow + ks * 16 + 8);
        Mma<T>::run(s[nt], qa[ks], b0, b1);
      }
    }

    // Causal mask, scale, online softmax (rows spread over the 4 lanes of a quad).
    float mxA = mA, mxB = mB;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int pos = kt * kBN + nt * 8 + 2 * t4 + e;
        s[nt][e] = pos <= lastA ? s[nt][e] * p.scale_log2 : -INFINITY;
        s[nt][2 + e] = pos <= lastB ? s[nt][2 + e] * p.scale_log2 : -INFINITY;
        mxA = fmaxf(mxA, s[nt][e]);
        mxB = fmaxf(mxB, s[nt][2 + e]);
      }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, off));
      mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, off));
    }
    const float alphaA = exp2f(mA - mxA), alphaB = exp2f(mB - mxB);
    mA = mxA;
    mB = mxB;
    lA *= alphaA;
    lB *= alphaB;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= alphaA;
      o[dt][1] *= alphaA;
      o[dt][2] *= alphaB;
      o[dt][3] *= alphaB;
    }
    // P as A fragments: S n-tiles 2kk and 2kk+1 form the 16x16 A operand of k-step kk.
    uint32_t pa[kBN / 16][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float p0 = exp2f(s[nt][0] - mA), p1 = exp2f(s[nt][1] - mA);
      const float p2 = exp2f(s[nt][2] - mB), p3 = exp2f(s[nt][3] - mB);
      lA += p0 + p1;
      lB += p2 + p3;
      pa[nt / 2][(nt & 1) * 2 + 0] = Elem<T>::pack(p0, p1);
      pa[nt / 2][(nt & 1) * 2 + 1] = Elem<T>::pack(p2, p3);
    }

    __syncthreads();  // every warp is done with K(kt)
    if (kt + 1 < ntiles) {
      plan_tile(kt + 1);
      issue_tile(Ks, kpool);
    }
    cp_async_commit();
    cp_async_wait<1>();  // V(kt) has landed
    __syncthreads();

    // O += P V: V fragments via ldmatrix.trans (matrices: keys 0-7 / 8-15 x dims dt, dt+1).
    const int mat = lane >> 3, mrow = lane & 7;
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const uint16_t* vrow = Vs + (kk * 16 + (mat & 1) * 8 + mrow) * LDS + (mat >> 1) * 8;
#pragma unroll
      for (int dt = 0; dt < DT; dt += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vrow + dt * 8);
        Mma<T>::run(o[dt], pa[kk], b[0], b[1]);
        Mma<T>::run(o[dt + 1], pa[kk], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with V(kt)
  }

#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    lA += __shfl_xor_sync(0xffffffffu, lA, off);
    lB += __shfl_xor_sync(0xffffffffu, lB, off);
  }
  const float invA = 1.f / lA, invB = 1.f / lB;
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    if (okA)
      *reinterpret_cast<uint32_t*>(out + headA * D + dt * 8 + 2 * t4) =
          Elem<T>::pack(o[dt][0] * invA, o[dt][1] * invA);
    if (okB)
      *reinterpret_cast<uint32_t*>(out + headB * D + dt * 8 + 2 * t4) =
          Elem<T>::pack(o[dt][2] * invB, o[dt][3] * invB);
  }
}


template <typename T, int D>
__global__ void __launch_bounds__(kPrefillThreads)
prefill_kernel(const PrefillParams p) {
  __shared__ __align__(16) uint16_t Ks[kBN * (D + 8)];
  __shared__ __align__(16) uint16_t Vs[kBN * (D + 8)];
  TL_EMU_POISON(Ks);
  TL_EMU_POISON(Vs);
  const int seq = blockIdx.z, kvh = blockIdx.y;
  const int q_start = static_cast<int>(p.query_start_loc[seq]);
  const int rows = (static_cast<int>(p.query_start_loc[seq + 1]) - q_start) * p.group;
  const int ctx = static_cast<int>(p.context_lens[seq]);
  // Row tiles round-robin over blockIdx.x, so any grid covers every row (a too-small
  // max_query_len costs speed, never correctness). Each tile ends with a barrier.
  for (int row0 = blockIdx.x * kBM; row0 < rows; row0 += gridDim.x * kBM)
    prefill_row_tile<T, D>(p, seq, kvh, q_start, rows, ctx, row0, Ks, Vs);
}

template <typename T, int D>
int launch_typed(const PrefillParams& prm, dim3 grid, cudaStream_t stream) {
  auto* kernel = prefill_kernel<T, D>;
  TL_LAUNCH(kernel, grid, kPrefillThreads, 0, stream, prm);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_prefill(bool bf16, const void* query, const void* key_cache, const void* value_cache,
                   void* out, const int64_t* block_tables, const int64_t* context_lens,
                   const int64_t* query_start_loc, int num_seqs, int max_query_len,
                   int num_heads, int num_kv_heads, int head_dim, int block_size,
                   int max_blocks_per_seq, float scale, cudaStream_t stream) {
  if (num_seqs <= 0 || max_query_len <= 0) return 0;
  PrefillParams prm{};
  prm.query = query;
  prm.key_cache = key_cache;
  prm.value_cache = value_cache;
  prm.out = out;
  prm.block_tables = block_tables;
  prm.context_lens = context_lens;
  prm.query_start_loc = query_start_loc;
  prm.num_heads = num_heads;
  prm.num_kv_heads = num_kv_heads;
  prm.group = num_heads / num_kv_heads;
  prm.log2_block_size = ilog2(block_size);
  prm.max_blocks_per_seq = max_blocks_per_seq;
  prm.scale_log2 = scale * kLog2e;
  const int64_t row_tiles = (static_cast<int64_t>(max_query_len) * prm.group + kBM - 1) / kBM;
  if (row_tiles > 0x7fffffff || num_kv_heads > 65535 || num_seqs > 65535) return TL_ERR_SHAPE;
  const dim3 grid(static_cast<unsigned>(row_tiles), num_kv_heads, num_seqs);
  if (bf16) {
    return head_dim == 64 ? launch_typed<__nv_bfloat16, 64>(prm, grid, stream)
                          : launch_typed<__nv_bfloat16, 128>(prm, grid, stream);
  }
  return head_dim == 64 ? launch_typed<__half, 64>(prm, grid, stream)
                        : launch_typed<__half, 128>(prm, grid, stream);
}

}  // namespace tl
