// Decode attention: split plan (how many splits of how many positions) and launches.
// The kernels and their design are in decode_kernels.cuh.
#include "decode_kernels.cuh"
#include "launch.h"

namespace tl {

namespace {

constexpr int kChunkAlign = 128;  // split sizes are multiples of every tile size

struct Policy {
  int min_chunk = 256;    // fewest positions per split
  int ctas_per_sm = 0;    // resident blocks per SM to plan for; 0: the kernel's occupancy
  int kernel = TL_DECODE_MMA;
  int mma_prefetch = -1;  // TL_DECODE_MMA: 0/1 forced, -1: on for head_dim 128 only
};
Policy g_policy;


// Whether decode_split_mma_kernel prefetches (the policy's choice, else on for D = 128 only).
bool mma_prefetch(int head_dim) {
  return g_policy.mma_prefetch >= 0 ? g_policy.mma_prefetch != 0 : head_dim == 128;
}

template <typename T, int D>
const void* mma_kernel_for(bool prefetch) {
  return prefetch ? reinterpret_cast<const void*>(decode_split_mma_kernel<T, D, true>)
                  : reinterpret_cast<const void*>(decode_split_mma_kernel<T, D, false>);
}

// The split kernel the policy launches for these sizes (its fp16 instance: fp16 and bf16 use the
// same registers and shared memory).
const void* split_kernel_for(int kernel, int head_dim, int gm) {
  if (kernel == TL_DECODE_MMA) {
    return head_dim == 128 ? mma_kernel_for<__half, 128>(mma_prefetch(128))
                           : mma_kernel_for<__half, 64>(mma_prefetch(64));
  }
#define TL_PICK(D, GM)                                                                      \
  return kernel == TL_DECODE_REGISTERS                                                      \
             ? reinterpret_cast<const void*>(decode_split_registers_kernel<__half, D, GM>)  \
             : reinterpret_cast<const void*>(decode_split_pipelined_kernel<__half, D, GM>)
  if (head_dim == 128) {
    if (gm == 1) TL_PICK(128, 1); else if (gm == 2) TL_PICK(128, 2);
    else if (gm == 4) TL_PICK(128, 4); else TL_PICK(128, 8);
  } else {
    if (gm == 1) TL_PICK(64, 1); else if (gm == 2) TL_PICK(64, 2);
    else if (gm == 4) TL_PICK(64, 4); else TL_PICK(64, 8);
  }
#undef TL_PICK
}

// Resident split-kernel blocks per SM (cudaOccupancy..., cached per kernel).
int resident_blocks(int kernel, int head_dim, int gm) {
  if (g_policy.ctas_per_sm > 0) return g_policy.ctas_per_sm;
  struct Entry { const void* fn; int blocks; };
  static Entry cache[32] = {};
  const void* fn = split_kernel_for(kernel, head_dim, gm);
  for (const Entry& e : cache) {
    if (e.fn == fn) return e.blocks;
  }
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, kDecodeThreads, 0) !=
          cudaSuccess || blocks <= 0) {
    cudaGetLastError();
    blocks = 2;
  }
  for (Entry& e : cache) {
    if (e.fn == nullptr) {
      e = Entry{fn, blocks};
      break;
    }
  }
  return blocks;
}

// Splits per sequence: at least enough blocks to fill every SM once, then the fewest whose
// last wave is >= 90% full (thread blocks of one launch take about equal time).
int64_t choose_splits(int64_t blocks, int64_t slots, int64_t max_splits) {
  const int64_t fill = (slots + blocks - 1) / blocks;
  if (fill >= max_splits) return max_splits;
  int64_t best = fill;
  double best_eff = 0.0;
  for (int64_t s = fill; s <= max_splits && s <= 4 * fill; ++s) {
    const int64_t total = blocks * s;
    const double eff = static_cast<double>(total) / (((total + slots - 1) / slots) * slots);
    if (eff > best_eff + 1e-9) {
      best = s;
      best_eff = eff;
    }
    if (eff >= 0.9) break;
  }
  return best;
}

// Query heads of one KV group per thread block: the MMA kernel always takes kMmaHeads (its
// rows); the others take the group rounded up to 1, 2, 4 or 8.
int heads_per_cta(int kernel, int group) {
  if (kernel == TL_DECODE_MMA) return kMmaHeads;
  return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8;
}

template <typename T, int D, int GM>
int launch_split(const DecodeParams& prm, dim3 grid, cudaStream_t stream) {
  auto* kernel = g_policy.kernel == TL_DECODE_REGISTERS ? decode_split_registers_kernel<T, D, GM>
                                                         : decode_split_pipelined_kernel<T, D, GM>;
  TL_LAUNCH(kernel, grid, kDecodeThreads, 0, stream, prm);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int D>
int launch_split_mma(const DecodeParams& prm, dim3 grid, cudaStream_t stream) {
  auto* kernel = mma_prefetch(D) ? decode_split_mma_kernel<T, D, true>
                                 : decode_split_mma_kernel<T, D, false>;
  TL_LAUNCH(kernel, grid, kDecodeThreads, 0, stream, prm);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int D>
int launch_typed(const DecodeParams& prm, const DecodePlan& plan, int num_seqs,
                 cudaStream_t stream) {
  const dim3 grid(plan.num_splits, prm.num_kv_heads * prm.head_chunks, num_seqs);
  int err = 0;
  if (g_policy.kernel == TL_DECODE_MMA) {
    err = launch_split_mma<T, D>(prm, grid, stream);
  } else {
    switch (plan.heads_per_cta) {
      case 1: err = launch_split<T, D, 1>(prm, grid, stream); break;
      case 2: err = launch_split<T, D, 2>(prm, grid, stream); break;
      case 4: err = launch_split<T, D, 4>(prm, grid, stream); break;
      default: err = launch_split<T, D, 8>(prm, grid, stream); break;
    }
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

void set_decode_mma_prefetch(int prefetch) { g_policy.mma_prefetch = prefetch < 0 ? -1 : prefetch != 0; }

int set_decode_kernel(int kernel) {
  if (kernel != TL_DECODE_PIPELINED && kernel != TL_DECODE_REGISTERS && kernel != TL_DECODE_MMA)
    return TL_ERR_KERNEL;
  g_policy.kernel = kernel;
  return 0;
}

DecodePlan plan_decode_for(int kernel, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int max_seq_len) {
  DecodePlan plan{};
  const int group = num_heads / num_kv_heads;
  plan.heads_per_cta = heads_per_cta(kernel, group);
  const int head_chunks = (group + plan.heads_per_cta - 1) / plan.heads_per_cta;
  const int64_t blocks = static_cast<int64_t>(num_seqs) * num_kv_heads * head_chunks;
  const int64_t slots =
      static_cast<int64_t>(sm_count()) * resident_blocks(kernel, head_dim, plan.heads_per_cta);
  max_seq_len = max_seq_len > 1 ? max_seq_len : 1;
  const int64_t max_splits =
      (static_cast<int64_t>(max_seq_len) + g_policy.min_chunk - 1) / g_policy.min_chunk;
  const int64_t want = blocks >= slots ? 1 : choose_splits(blocks, slots, max_splits);
  plan.chunk = max_seq_len;
  plan.num_splits = 1;
  if (want > 1) {   // int64: max_seq_len and min_chunk may each be near INT_MAX
    int64_t chunk = (static_cast<int64_t>(max_seq_len) + want - 1) / want;
    chunk = (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    chunk = chunk > g_policy.min_chunk ? chunk : g_policy.min_chunk;
    if (chunk < max_seq_len) {
      plan.chunk = static_cast<int>(chunk);
      plan.num_splits = static_cast<int>((max_seq_len + chunk - 1) / chunk);
    }
  }
  plan.workspace_bytes =
      plan.num_splits == 1
          ? 0
          : static_cast<size_t>(num_seqs) * num_heads * plan.num_splits * (head_dim + 2) *
                sizeof(float);
  return plan;
}

DecodePlan plan_decode(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                       int max_seq_len) {
  return plan_decode_for(g_policy.kernel, num_seqs, num_heads, num_kv_heads, head_dim,
                         max_seq_len);
}

size_t decode_workspace_bound(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                              int max_seq_len) {
  size_t most = 0;
  for (int kernel : {TL_DECODE_PIPELINED, TL_DECODE_REGISTERS, TL_DECODE_MMA}) {
    const size_t b = plan_decode_for(kernel, num_seqs, num_heads, num_kv_heads, head_dim,
                                     max_seq_len).workspace_bytes;
    most = b > most ? b : most;
  }
  return most;
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
  prm.head_chunks = (prm.group + plan.heads_per_cta - 1) / plan.heads_per_cta;  // as planned
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
