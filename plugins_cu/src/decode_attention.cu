// Decode attention: split plan (how many splits of how many positions) and launches.
// The kernels and their design are in decode_kernels.cuh.
#include "decode_kernels.cuh"
#include "launch.h"

namespace tl {

namespace {

constexpr int kChunkAlign = 128;  // split sizes are multiples of every tile size

struct Policy {
  int min_chunk = 256;
  int ctas_per_sm = 8;
  int kernel = TL_DECODE_PIPELINED;
};
Policy g_policy;

int heads_per_cta(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

template <typename T, int D, int GM>
int launch_split(const DecodeParams& prm, dim3 grid, cudaStream_t stream) {
  auto* kernel = g_policy.kernel == TL_DECODE_REGISTERS ? decode_split_registers_kernel<T, D, GM>
                                                         : decode_split_pipelined_kernel<T, D, GM>;
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

int set_decode_kernel(int kernel) {
  if (kernel != TL_DECODE_PIPELINED && kernel != TL_DECODE_REGISTERS) return TL_ERR_SHAPE;
  g_policy.kernel = kernel;
  return 0;
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
