// Device helpers shared by the trtllm-lite kernels: element types, 16-byte loads, conversions,
// cp.async and the m16n8k16 tensor-core MMA. Units: "elements" are fp16/bf16 values (2 bytes).
#pragma once

#ifdef TL_EMULATE
#include "../emulation/cuda_emulation.h"  // host build for checks without a GPU
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif
#include <stdint.h>

#include "trtllm_lite_kernels.h"

// Kernel launch. `kernel` must be a plain name (take a pointer to a template instance first).
#ifdef TL_EMULATE
#define TL_LAUNCH(kernel, grid, block, smem, stream, ...) \
  tl_emu::launch(grid, block, [&]() { kernel(__VA_ARGS__); })
#define TL_EMU_POISON(shared_array) tl_emu::poison_shared_once(shared_array, sizeof(shared_array))
#else
#define TL_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define TL_EMU_POISON(shared_array) ((void)0)
#endif

namespace tl {

constexpr float kLog2e = 1.4426950408889634f;
// Finite "minus infinity" for running maxima: exp2(m_old - m_new) never sees inf - inf.
constexpr float kNegBig = -1.0e30f;

// 8 packed 16-bit elements = one 16-byte vector.
struct alignas(16) Vec8 {
  uint32_t w[4];
};

// Read-once 16-byte global load: bypasses L1 allocation (K/V are streamed exactly once).
__device__ __forceinline__ Vec8 ld_stream(const void* p) {
  Vec8 v;
#ifdef TL_EMULATE
  memcpy(&v, p, 16);
#else
  asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
      : "l"(p));
#endif
  return v;
}

__device__ __forceinline__ Vec8 ld_vec(const void* p) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  Vec8 v;
  v.w[0] = u.x; v.w[1] = u.y; v.w[2] = u.z; v.w[3] = u.w;
  return v;
}

// 2^x with the special-function unit (ex2.approx.ftz: about 2 ulp; flushes subnormal results
// to 0, harmless for softmax weights).
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef TL_EMULATE
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// Element-type traits: unpack a 32-bit pair to two floats and pack two floats to a pair.
template <typename T> struct Elem;

template <> struct Elem<__half> {
  __device__ __forceinline__ static float2 unpack(uint32_t w) {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = w;
    return __half22float2(h);
  }
  __device__ __forceinline__ static uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static __half from_float(float a) { return __float2half_rn(a); }
};

template <> struct Elem<__nv_bfloat16> {
  // bf16 -> fp32 is a 16-bit shift: cheaper than a cvt instruction.
  __device__ __forceinline__ static float2 unpack(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  __device__ __forceinline__ static uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float a) {
    return __float2bfloat16_rn(a);
  }
};

template <typename T>
__device__ __forceinline__ void unpack8(const Vec8& v, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = Elem<T>::unpack(v.w[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// ---- cp.async (sm_80+): 16-byte global -> shared copies, zero-filled when !valid ----
#ifdef TL_EMULATE
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  tl_emu::cp_async(smem, gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() { tl_emu::cp_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  tl_emu::cp_wait(N);
}
#else
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
#endif

// ---- tensor cores: D[16x8] += A[16x16] * B[16x8], fp16/bf16 in, fp32 accumulate ----
// Fragment layout (PTX ISA, mma.m16n8k16), g = lane / 4, t = lane % 4:
//   A regs: a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t..), a2 (row g, k 2t+8..), a3 (row g+8, k 2t+8..)
//   B regs: b0 (k 2t..2t+1, col g), b1 (k 2t+8..2t+9, col g)
//   C/D:    c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8, cols 2t, 2t+1)
template <typename T> struct Mma;

#ifdef TL_EMULATE
template <typename T> struct Mma {
  static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    tl_emu::mma_m16n8k16(c, a, b0, b1, std::is_same<T, __nv_bfloat16>::value);
  }
};
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  tl_emu::ldmatrix_x4_trans(r, smem_row);
}
#else
template <> struct Mma<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ldmatrix .x4 .trans: lane l supplies the row address for matrix l / 8, row l % 8. Each lane gets,
// for matrix i, the stored elements (row 2t, col g) and (row 2t+1, col g): a B fragment when the
// stored rows are the MMA's k index (e.g. V[token][dim] with k = token, n = dim).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
#endif  // TL_EMULATE

__host__ __device__ constexpr int ilog2(int x) { return x <= 1 ? 0 : 1 + ilog2(x >> 1); }

}  // namespace tl
