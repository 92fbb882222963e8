// Internal host-side launchers (namespace tl), called by the C ABI in api.cu.
// Shapes and semantics: include/trtllm_lite_kernels.h. All return 0 or a cudaError_t.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace tl {

int launch_kv_write(const void* key, const void* value, void* key_cache, void* value_cache,
                    const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                    cudaStream_t stream);

// Decode split plan: `chunk` tokens per split, `num_splits` splits (1 = no merge pass).
struct DecodePlan {
  int chunk;
  int num_splits;
  int heads_per_cta;  // query heads of one KV group handled by one thread block (1, 2, 4 or 8)
  size_t workspace_bytes;
};
DecodePlan plan_decode(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                       int max_seq_len);
// Workspace that covers the plan of either decode kernel (what tl_decode_workspace_size returns).
size_t decode_workspace_bound(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                              int max_seq_len);
void set_decode_policy(int min_chunk, int ctas_per_sm);
int set_decode_kernel(int kernel);  // TL_DECODE_MMA (default), TL_DECODE_PIPELINED or TL_DECODE_REGISTERS
void set_decode_mma_prefetch(int prefetch);  // 0 / 1; < 0: on for head_dim 128 only

int launch_decode(bool bf16, const void* query, const void* key_cache, const void* value_cache,
                  void* out, const int64_t* block_tables, const int64_t* context_lens,
                  int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                  int max_blocks_per_seq, int max_seq_len, float scale, void* workspace,
                  size_t workspace_size, cudaStream_t stream);

int launch_prefill(bool bf16, const void* query, const void* key_cache, const void* value_cache,
                   void* out, const int64_t* block_tables, const int64_t* context_lens,
                   const int64_t* query_start_loc, int num_seqs, int max_query_len,
                   int num_heads, int num_kv_heads, int head_dim, int block_size,
                   int max_blocks_per_seq, float scale, cudaStream_t stream);

// Multiprocessor count of the current device (cached per device; 132 if it cannot be read).
int sm_count();

}  // namespace tl
