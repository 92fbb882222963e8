/*
 * trtllm-lite CUDA kernels: C ABI.
 *
 * The kernels implement the trtllm_lite::PagedAttention op (schema and numpy reference in
 * builder/paged_attention.py). All pointers are device pointers; all calls are asynchronous on
 * `stream` and return 0 on success, a CUDA error code (cudaError_t, > 0) for a CUDA failure, or
 * TL_ERR_* (< 0) for an unsupported argument. tl_error_string() turns either into text.
 *
 * Tensor layouts (element type `dtype`: TL_DTYPE_FP16 or TL_DTYPE_BF16, row-major, contiguous):
 *   query        [num_tokens, num_heads, head_dim]
 *   key, value   [num_tokens, num_kv_heads, head_dim]                 the step's new K/V
 *   key_cache,
 *   value_cache  [num_blocks, block_size, num_kv_heads, head_dim]     one layer's K/V pool
 *   out          [num_tokens, num_heads, head_dim]
 * Metadata (int64, as in the op schema):
 *   slot_mapping     [num_tokens]          flat pool slot (block * block_size + offset); < 0 skips
 *   block_tables     [num_seqs, max_blocks_per_seq]   logical -> physical block
 *   context_lens     [num_seqs]            tokens cached before the step
 *   query_start_loc  [num_seqs + 1]        packed offsets of each sequence's step tokens
 * Supported: head_dim 64 or 128; block_size a power of two (16, 32, 64 are the tested ones);
 * num_heads a multiple of num_kv_heads (MHA, GQA, MQA). Accumulation is fp32 throughout.
 */
#ifndef TRTLLM_LITE_KERNELS_H
#define TRTLLM_LITE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* tl_stream_t; /* the same type as cudaStream_t */

enum { TL_DTYPE_FP16 = 0, TL_DTYPE_BF16 = 1 };
enum {
  TL_ERR_DTYPE = -1,      /* dtype is neither fp16 nor bf16 */
  TL_ERR_HEAD_DIM = -2,   /* head_dim is not 64 or 128 */
  TL_ERR_BLOCK_SIZE = -3, /* block_size is not a power of two */
  TL_ERR_HEADS = -4,      /* num_heads is not a positive multiple of num_kv_heads */
  TL_ERR_WORKSPACE = -5,  /* workspace missing or smaller than tl_decode_workspace_size() */
  TL_ERR_SHAPE = -6,      /* a size is negative or too large for the grid */
  TL_ERR_KERNEL = -7      /* tl_set_decode_kernel: not a TL_DECODE_* value */
};

/* Version of this ABI (bumped on any signature change). */
int tl_abi_version(void);
/* How the library was built: "CUDA <major>.<minor>" or "CPU emulation" (plugins_cu/emulation). */
const char* tl_build_info(void);
const char* tl_error_string(int code);

/* Paged KV write: key_cache[slot_mapping[t]] = key[t], value_cache[...] = value[t]. */
int tl_paged_kv_write(int dtype, const void* key, const void* value, void* key_cache,
                      void* value_cache, const int64_t* slot_mapping, int num_tokens,
                      int num_kv_heads, int head_dim, int block_size, tl_stream_t stream);

/* Bytes of fp32 scratch the split-K (flash-decoding) decode needs; max_seq_len bounds
 * context_lens[s] + 1 over the batch (the split plan is sized from it; an understated bound
 * stays correct, only slower). 0 when no split is used. */
size_t tl_decode_workspace_size(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                int max_seq_len);

/* Decode attention: one query token per sequence (token s belongs to sequence s). Sequence s
 * attends pool positions [0, context_lens[s] + 1): the new token's K/V must already be in the
 * pool (tl_paged_kv_write). The context is split across thread blocks, each keeping an online
 * softmax; a second kernel merges the splits (flash-decoding). */
int tl_paged_attention_decode(int dtype, const void* query, const void* key_cache,
                              const void* value_cache, void* out, const int64_t* block_tables,
                              const int64_t* context_lens, int num_seqs, int num_heads,
                              int num_kv_heads, int head_dim, int block_size,
                              int max_blocks_per_seq, int max_seq_len, float scale,
                              void* workspace, size_t workspace_size, tl_stream_t stream);

/* Prefill / chunked-prefill attention: token j of sequence s attends pool positions
 * [0, context_lens[s] + j] (causal). The step's K/V must already be in the pool. Tiled with an
 * online softmax on tensor cores (FlashAttention-2 style); no score matrix is stored.
 * max_query_len bounds the per-sequence query length (<= 0: use num_tokens); it only sizes the
 * grid, so an understated bound stays correct, only slower. */
int tl_paged_attention_prefill(int dtype, const void* query, const void* key_cache,
                               const void* value_cache, void* out, const int64_t* block_tables,
                               const int64_t* context_lens, const int64_t* query_start_loc,
                               int num_seqs, int num_tokens, int max_query_len, int num_heads,
                               int num_kv_heads, int head_dim, int block_size,
                               int max_blocks_per_seq, float scale, tl_stream_t stream);

/* The whole op: write the step's K/V into the pools, then run decode attention when every
 * sequence has exactly one token (num_tokens == num_seqs and max_query_len == 1), else prefill.
 * max_seq_len bounds context_lens[s] + query length (<= 0: max_blocks_per_seq * block_size). */
int tl_paged_attention(int dtype, const void* query, const void* key, const void* value,
                       void* key_cache, void* value_cache, void* out,
                       const int64_t* slot_mapping, const int64_t* block_tables,
                       const int64_t* context_lens, const int64_t* query_start_loc,
                       int num_seqs, int num_tokens, int max_query_len, int max_seq_len,
                       int num_heads, int num_kv_heads, int head_dim, int block_size,
                       int max_blocks_per_seq, float scale, void* workspace,
                       size_t workspace_size, tl_stream_t stream);

/* Decode split policy (for tuning and benchmarks): a split covers at least min_chunk positions
 * (default 256); the plan fills every SM and keeps the last wave of thread blocks >= 90% full,
 * assuming ctas_per_sm resident blocks per SM (default: the kernel's measured occupancy).
 * Values <= 0 restore the defaults. */
void tl_set_decode_policy(int min_chunk, int ctas_per_sm);
/* Decode split kernel (same results within rounding; for tuning and benchmarks). */
enum { TL_DECODE_PIPELINED = 0, /* CUDA cores, cp.async into a 3-stage shared-memory ring */
       TL_DECODE_REGISTERS = 1, /* CUDA cores, 16-byte read-once loads straight into registers */
       TL_DECODE_MMA = 2        /* tensor cores (mma.m16n8k16), fragments loaded from the pool
                                   (default) */ };
int tl_set_decode_kernel(int kernel);
/* TL_DECODE_MMA: 1 = load a warp's next 16 positions while computing these, 0 = don't;
 * < 0 restores the default (on for head_dim 128, off for 64). */
void tl_set_decode_mma_prefetch(int prefetch);
/* Number of context splits the decode would use for these sizes (1 = no merge pass). */
int tl_decode_num_splits(int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int max_seq_len);

/* Minimal device-memory helpers so a caller needs neither torch nor cuda-python. */
int tl_device_count(int* count);
int tl_malloc(void** ptr, size_t bytes);
int tl_free(void* ptr);
int tl_memcpy_htod(void* dst, const void* src, size_t bytes);
int tl_memcpy_dtoh(void* dst, const void* src, size_t bytes);
int tl_memset(void* ptr, int value, size_t bytes);
int tl_synchronize(void);

#ifdef __cplusplus
}
#endif

#endif /* TRTLLM_LITE_KERNELS_H */
