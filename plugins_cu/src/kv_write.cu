// Paged KV write: the step's new K/V rows go to their pool slots.
//
//   key, value            [num_tokens, num_kv_heads, head_dim]              fp16/bf16
//   key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]  fp16/bf16
//   slot_mapping          [num_tokens] int64, slot = block * block_size + offset (< 0: skip)
//
// A pool slot holds num_kv_heads * head_dim contiguous elements, exactly one token's new K (or V),
// so the copy is dtype-agnostic: each thread moves one 16-byte vector (8 elements) of K and of V.
#include "common.cuh"
#include "launch.h"

namespace tl {

__global__ void __launch_bounds__(256)
paged_kv_write_kernel(const Vec8* __restrict__ key, const Vec8* __restrict__ value,
                      Vec8* __restrict__ key_cache, Vec8* __restrict__ value_cache,
                      const int64_t* __restrict__ slot_mapping, int64_t total_vecs,
                      int vecs_per_token) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total_vecs;
       i += stride) {
    const int64_t t = i / vecs_per_token;
    const int64_t r = i - t * vecs_per_token;
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    const int64_t dst = slot * vecs_per_token + r;
    key_cache[dst] = key[i];
    value_cache[dst] = value[i];
  }
}

int launch_kv_write(const void* key, const void* value, void* key_cache, void* value_cache,
                    const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim,
                    cudaStream_t stream) {
  if (num_tokens <= 0) return 0;
  const int vecs_per_token = num_kv_heads * head_dim / 8;
  const int64_t total = static_cast<int64_t>(num_tokens) * vecs_per_token;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const int grid = static_cast<int>(blocks < 65536 ? blocks : 65536);
  auto* kernel = paged_kv_write_kernel;
  TL_LAUNCH(kernel, grid, threads, 0, stream, static_cast<const Vec8*>(key),
            static_cast<const Vec8*>(value), static_cast<Vec8*>(key_cache),
            static_cast<Vec8*>(value_cache), slot_mapping, total, vecs_per_token);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace tl
