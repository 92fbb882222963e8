// The C ABI of include/trtllm_lite_kernels.h: argument checks, dispatch to the launchers, and
// small device-memory helpers (so Python can drive the kernels through ctypes alone).
#include "common.cuh"
#include "launch.h"
#include "trtllm_lite_kernels.h"

namespace tl {

int sm_count() {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return 132;
  }
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = 132;
    }
    cached[dev] = n;
  }
  return cached[dev];
}

}  // namespace tl

namespace {

int check_common(int dtype, int num_heads, int num_kv_heads, int head_dim, int block_size) {
  if (dtype != TL_DTYPE_FP16 && dtype != TL_DTYPE_BF16) return TL_ERR_DTYPE;
  if (head_dim != 64 && head_dim != 128) return TL_ERR_HEAD_DIM;
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0) return TL_ERR_BLOCK_SIZE;
  if (num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads != 0) return TL_ERR_HEADS;
  return 0;
}

}  // namespace

extern "C" {

int tl_abi_version(void) { return 1; }

#define TL_STR2(x) #x
#define TL_STR(x) TL_STR2(x)
const char* tl_build_info(void) {
#ifdef TL_EMULATE
  return "CPU emulation";
#else
  return "CUDA " TL_STR(__CUDACC_VER_MAJOR__) "." TL_STR(__CUDACC_VER_MINOR__);
#endif
}

const char* tl_error_string(int code) {
  switch (code) {
    case 0: return "success";
    case TL_ERR_DTYPE: return "unsupported dtype (expected fp16 or bf16)";
    case TL_ERR_HEAD_DIM: return "unsupported head_dim (expected 64 or 128)";
    case TL_ERR_BLOCK_SIZE: return "block_size must be a power of two";
    case TL_ERR_HEADS: return "num_heads must be a positive multiple of num_kv_heads";
    case TL_ERR_WORKSPACE: return "decode workspace missing or smaller than tl_decode_workspace_size()";
    case TL_ERR_SHAPE: return "a size is negative or too large for the launch grid";
    case TL_ERR_KERNEL: return "unknown decode kernel (expected TL_DECODE_MMA, _PIPELINED or _REGISTERS)";
    default: break;
  }
  return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown error";
}

int tl_paged_kv_write(int dtype, const void* key, const void* value, void* key_cache,
                      void* value_cache, const int64_t* slot_mapping, int num_tokens,
                      int num_kv_heads, int head_dim, int block_size, tl_stream_t stream) {
  const int err = check_common(dtype, num_kv_heads, num_kv_heads, head_dim, block_size);
  if (err) return err;
  if (num_tokens < 0) return TL_ERR_SHAPE;
  return tl::launch_kv_write(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                             num_kv_heads, head_dim, stream);
}

size_t tl_decode_workspace_size(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                int max_seq_len) {
  if (num_seqs <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 0;
  return tl::decode_workspace_bound(num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len);
}

int tl_decode_num_splits(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int max_seq_len) {
  if (num_seqs <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 0;
  return tl::plan_decode(num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len).num_splits;
}

void tl_set_decode_policy(int min_chunk, int ctas_per_sm) {
  tl::set_decode_policy(min_chunk, ctas_per_sm);
}

int tl_set_decode_kernel(int kernel) { return tl::set_decode_kernel(kernel); }

void tl_set_decode_mma_prefetch(int prefetch) { tl::set_decode_mma_prefetch(prefetch); }

int tl_paged_attention_decode(int dtype, const void* query, const void* key_cache,
                              const void* value_cache, void* out, const int64_t* block_tables,
                              const int64_t* context_lens, int num_seqs, int num_heads,
                              int num_kv_heads, int head_dim, int block_size,
                              int max_blocks_per_seq, int max_seq_len, float scale,
                              void* workspace, size_t workspace_size, tl_stream_t stream) {
  const int err = check_common(dtype, num_heads, num_kv_heads, head_dim, block_size);
  if (err) return err;
  if (num_seqs < 0 || max_blocks_per_seq < 0) return TL_ERR_SHAPE;
  if (max_seq_len <= 0) max_seq_len = max_blocks_per_seq * block_size;
  return tl::launch_decode(dtype == TL_DTYPE_BF16, query, key_cache, value_cache, out,
                           block_tables, context_lens, num_seqs, num_heads, num_kv_heads,
                           head_dim, block_size, max_blocks_per_seq, max_seq_len, scale,
                           workspace, workspace_size, stream);
}

int tl_paged_attention_prefill(int dtype, const void* query, const void* key_cache,
                               const void* value_cache, void* out, const int64_t* block_tables,
                               const int64_t* context_lens, const int64_t* query_start_loc,
                               int num_seqs, int num_tokens, int max_query_len, int num_heads,
                               int num_kv_heads, int head_dim, int block_size,
                               int max_blocks_per_seq, float scale, tl_stream_t stream) {
  const int err = check_common(dtype, num_heads, num_kv_heads, head_dim, block_size);
  if (err) return err;
  if (num_seqs < 0 || num_tokens < 0 || max_blocks_per_seq < 0) return TL_ERR_SHAPE;
  if (max_query_len <= 0 || max_query_len > num_tokens) max_query_len = num_tokens;
  return tl::launch_prefill(dtype == TL_DTYPE_BF16, query, key_cache, value_cache, out,
                            block_tables, context_lens, query_start_loc, num_seqs,
                            max_query_len, num_heads, num_kv_heads, head_dim, block_size,
                            max_blocks_per_seq, scale, stream);
}

int tl_paged_attention(int dtype, const void* query, const void* key, const void* value,
                       void* key_cache, void* value_cache, void* out,
                       const int64_t* slot_mapping, const int64_t* block_tables,
                       const int64_t* context_lens, const int64_t* query_start_loc,
                       int num_seqs, int num_tokens, int max_query_len, int max_seq_len,
                       int num_heads, int num_kv_heads, int head_dim, int block_size,
                       int max_blocks_per_seq, float scale, void* workspace,
                       size_t workspace_size, tl_stream_t stream) {
  int err = tl_paged_kv_write(dtype, key, value, key_cache, value_cache, slot_mapping,
                              num_tokens, num_kv_heads, head_dim, block_size, stream);
  if (err) return err;
  if (num_tokens == num_seqs && max_query_len == 1) {
    return tl_paged_attention_decode(dtype, query, key_cache, value_cache, out, block_tables,
                                     context_lens, num_seqs, num_heads, num_kv_heads, head_dim,
                                     block_size, max_blocks_per_seq, max_seq_len, scale,
                                     workspace, workspace_size, stream);
  }
  return tl_paged_attention_prefill(dtype, query, key_cache, value_cache, out, block_tables,
                                    context_lens, query_start_loc, num_seqs, num_tokens,
                                    max_query_len, num_heads, num_kv_heads, head_dim,
                                    block_size, max_blocks_per_seq, scale, stream);
}

int tl_device_count(int* count) {
  *count = 0;
  const cudaError_t e = cudaGetDeviceCount(count);
  if (e != cudaSuccess) {
    *count = 0;
    cudaGetLastError();
  }
  return static_cast<int>(e);
}

int tl_malloc(void** ptr, size_t bytes) { return static_cast<int>(cudaMalloc(ptr, bytes)); }
int tl_free(void* ptr) { return static_cast<int>(cudaFree(ptr)); }
int tl_memcpy_htod(void* dst, const void* src, size_t bytes) {
  return static_cast<int>(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
int tl_memcpy_dtoh(void* dst, const void* src, size_t bytes) {
  return static_cast<int>(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
int tl_memset(void* ptr, int value, size_t bytes) {
  return static_cast<int>(cudaMemset(ptr, value, bytes));
}
int tl_synchronize(void) { return static_cast<int>(cudaDeviceSynchronize()); }

}  // extern "C"
