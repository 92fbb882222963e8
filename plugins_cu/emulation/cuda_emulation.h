// CPU emulation of the parts of the CUDA execution model the trtllm-lite kernels use, so the
// kernel sources (unchanged) can be compiled with a host C++ compiler and checked without a GPU.
//
// Compiled with -DTL_EMULATE (see plugins_cu/build.sh --emulation). Model:
//   * a launch runs its thread blocks one after another; each CUDA thread is a fiber (ucontext)
//     and fibers switch only at barriers, so `__shared__` variables become function statics;
//   * __syncthreads() is a block barrier; warp shuffles, mma.sync and ldmatrix are warp
//     collectives (every lane deposits its operands, the last to arrive releases the warp);
//     a barrier that some threads never reach is reported as an error (divergent barrier);
//   * cp.async copies land at cp.async.wait_group, as late as the PTX rules allow, and shared
//     memory starts filled with 0xFF bytes (NaN) in every block, so missing waits and reads of
//     unwritten shared memory show up as NaN;
//   * mma.m16n8k16 and ldmatrix follow the fragment layouts of the PTX ISA;
//   * device memory is host memory (cudaMalloc = aligned malloc), so AddressSanitizer, when the
//     library is built with it, catches out-of-bounds accesses.
// It checks indexing, fragment layouts and synchronization logic, not speed or memory ordering.
#pragma once

#ifndef TL_EMULATE
#error "cuda_emulation.h is for host builds with -DTL_EMULATE"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <type_traits>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

namespace tl_emu {

const uint3& thread_idx();
extern dim3 g_block_idx, g_grid_dim, g_block_dim;

// Runs body() once per CUDA thread of every block of `grid`; returns 0 or a cudaError_t.
int launch(dim3 grid, dim3 block, const std::function<void()>& body);

void syncthreads();
// Warp collective: deposit `bytes` (<= 64) from this lane; returns the 32 lanes' deposits
// (lane i at offset 64 * i), valid until this lane's next collective.
const unsigned char* warp_exchange(const void* in, size_t bytes);
int lane_id();

void poison_shared_once(void* p, size_t bytes);  // fill with 0xFF at the first use in a block
void cp_async(void* dst, const void* src, bool valid);
void cp_commit();
void cp_wait(int pending_allowed);

template <typename V>
V shfl_xor(V v, int lane_mask) {
  const unsigned char* all = warp_exchange(&v, sizeof(V));
  V out;
  memcpy(&out, all + 64 * (lane_id() ^ lane_mask), sizeof(V));
  return out;
}

// mma.m16n8k16 (row.col), fp32 accumulate; IsBf16 picks the operand type.
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool is_bf16);
void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_ptr);

}  // namespace tl_emu

#define threadIdx (tl_emu::thread_idx())
#define blockIdx (tl_emu::g_block_idx)
#define gridDim (tl_emu::g_grid_dim)
#define blockDim (tl_emu::g_block_dim)

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline void __syncthreads() { tl_emu::syncthreads(); }
template <typename V>
inline V __shfl_xor_sync(unsigned /*mask*/, V v, int lane_mask) {
  return tl_emu::shfl_xor(v, lane_mask);
}
inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
template <typename V>
inline V __ldg(const V* p) {
  return *p;
}
