// Fused elementwise ops around the attention, MLP and integer GEMMs, each replacing a chain of
// small ONNX Runtime nodes (and the copies between them) with one pass over the data:
//
// trtllm_lite::RotarySplitQKV   the fused QKV projection's output -> rotated q, rotated k, v
//   inputs   qkv [T, (H + 2 Hkv) * D] float32, positions [T] int64,
//            cos_cache, sin_cache [max_positions, D / 2] float32
//   attrs    num_heads H, num_kv_heads Hkv (int)
//   outputs  q [T, H, D], k [T, Hkv, D], v [T, Hkv, D] float32
//   Rotary embedding, rotate-half form (RoFormer, Su et al. 2021; HF Llama's rotate_half):
//   for i < D/2, c = cos[p, i], s = sin[p, i]: y_i = x_i c - x_{i+D/2} s, y_{i+D/2} = x_{i+D/2} c + x_i s.
//
// trtllm_lite::SiluAndMul   the fused gate/up projection's output -> SwiGLU activation
//   input    gate_up [T, 2 I] float32 (gate columns first); output [T, I] = silu(gate) * up,
//   silu(x) = x / (1 + e^-x) (Shazeer 2020, "GLU variants improve Transformer"; vLLM's silu_and_mul)
//
// trtllm_lite::SkipRMSNorm   the residual add and the RMS norm after it
//   inputs   x [T, H], skip [T, H], gamma [H] float32; attr epsilon (float)
//   outputs  y [T, H] = (x + skip) / sqrt(mean((x + skip)^2) + epsilon) * gamma, sum [T, H] = x + skip
//   (RMSNorm: Zhang and Sennrich 2019), bit for bit ONNX Runtime's
//   SkipSimplifiedLayerNormalization (its outputs 0 and 3), which the function body is.
//
// trtllm_lite::QuantizeRows   a w8a8 linear's input -> its int8 codes per token (row), in planes
//   input    x [T, K] float32; attr planes (1 or 2)
//   outputs  q [planes T, K] uint8, scale [planes T, 1] float32
//   s = max(max_k |x[t, k]| * (1 / 127), 1e-30 / 127), v = x * (1 / s); plane 0: rint(v) + 128,
//   scale s; plane 1: rint((v - rint(v)) * 254) + 128, scale s / 254 (round half to even and
//   zero point 128, as QuantizeLinear): the per-token dynamic activation quantization of
//   SmoothQuant (Xiao et al. 2023) and vLLM's scaled_int8_quant, shifted to uint8 for ONNX
//   Runtime's u8s8 integer GEMM; the second plane carries the first's rounding error. A row
//   holding a NaN or an infinity gets scale NaN (its codes are meaningless), so DequantizeRows
//   gives a NaN row, as float32 arithmetic would give a non-finite one.
//
// trtllm_lite::DequantizeRows   the integer GEMM's planes -> float32
//   inputs   y [planes T, N], scale [planes T, 1], bias [N] float32; attr planes
//   output   [T, N] = sum over planes of y * scale, + bias
//
// trtllm_lite::BlockHadamard   a w8a8 down projection's input, rotated (--rotate-activations)
//   inputs   x [T, K] float32, hadamard [b, b] float32 (b a power of two dividing K: the
//            normalized Sylvester Hadamard matrix H_b, builder/rotation.py; any other matrix
//            is an INVALID_ARGUMENT: its values are checked once per buffer)
//   output   [T, K]: each row's consecutive blocks of b values times H_b (symmetric), computed as
//            the fast Walsh-Hadamard transform (b log2 b additions per block) scaled by 1 / sqrt(b). The rotation spreads an
//            outlier channel over its block before per-token int8 quantization (QuaRot, Ashkboos
//            et al. 2024, "Outlier-free 4-bit inference in rotated LLMs").
#include <atomic>

#include "kernel_common.h"

namespace trtllm_lite_kernels {
namespace {

constexpr int64_t kRowsPerItem = 8;   // tokens per parallel work item
// RotarySplitQKV and SiluAndMul hand out calls of this many elements or more (kSerialWork's
// 2^18 kept SmolLM2's up to 170 tokens in one thread; step-interleaved, fp32 decode steps of
// 16 / 32 sequences: 1.005-1.015x / 1.018-1.021x with 2^14)
constexpr int64_t kSerialElements = 1 << 14;

// ---- RotarySplitQKV ------------------------------------------------------------------------
constexpr ONNXTensorElementDataType kRotaryInputs[4] = {kF32, kI64, kF32, kF32};

struct RotaryStep {
  const float *qkv, *cos, *sin;
  const int64_t* positions;
  float *q, *k, *v;
  int64_t tokens, heads, kv_heads, head_dim;
};

void rotate_rows(void* user, size_t item) {
  const RotaryStep& st = *static_cast<const RotaryStep*>(user);
  const int64_t d = st.head_dim, half = d / 2, width = (st.heads + 2 * st.kv_heads) * d;
  const int64_t end = std::min(st.tokens, static_cast<int64_t>(item + 1) * kRowsPerItem);
  for (int64_t t = static_cast<int64_t>(item) * kRowsPerItem; t < end; ++t) {
    const float* row = st.qkv + t * width;
    const float* c = st.cos + st.positions[t] * half;
    const float* s = st.sin + st.positions[t] * half;
    for (int64_t h = 0; h < st.heads + st.kv_heads; ++h) {
      const float* x = row + h * d;
      float* y = h < st.heads ? st.q + (t * st.heads + h) * d : st.k + (t * st.kv_heads + h - st.heads) * d;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        y[i] = x[i] * c[i] - x[i + half] * s[i];
        y[i + half] = x[i + half] * c[i] + x[i] * s[i];
      }
    }
    std::memcpy(st.v + t * st.kv_heads * d, row + (st.heads + st.kv_heads) * d, sizeof(float) * st.kv_heads * d);
  }
}

struct RotaryKernel : KernelBase {
  int64_t heads = 0, kv_heads = 0;
  OrtStatus* compute(OrtKernelContext* context) override;
};

OrtStatus* RotaryKernel::compute(OrtKernelContext* context) {
  Tensor qkv, positions, cos, sin;
  RETURN_IF_ERROR(read_inputs(context, &qkv, &positions, &cos, &sin));
  if (qkv.dims.size() != 2 || positions.dims.size() != 1 || positions.dims[0] != qkv.dims[0])
    return error(ORT_INVALID_ARGUMENT, "RotarySplitQKV: qkv " + dims_string(qkv.dims) + " and positions " +
                                           dims_string(positions.dims) + " must be [T, width] and [T]");
  const int64_t T = qkv.dims[0], n = heads + 2 * kv_heads;
  if (cos.dims.size() != 2 || cos.dims != sin.dims || n <= 0 || qkv.dims[1] != n * 2 * cos.dims[1])
    return error(ORT_INVALID_ARGUMENT, "RotarySplitQKV: qkv " + dims_string(qkv.dims) + " is not " +
                                           std::to_string(n) + " heads of twice cos_cache " +
                                           dims_string(cos.dims) + "'s width (sin_cache " + dims_string(sin.dims) + ")");
  RotaryStep st{};
  st.tokens = T;
  st.heads = heads;
  st.kv_heads = kv_heads;
  st.head_dim = 2 * cos.dims[1];
  RETURN_IF_ERROR(data_of(qkv, &st.qkv));
  RETURN_IF_ERROR(data_of(positions, &st.positions));
  RETURN_IF_ERROR(data_of(cos, &st.cos));
  RETURN_IF_ERROR(data_of(sin, &st.sin));
  for (int64_t t = 0; t < T; ++t)
    if (st.positions[t] < 0 || st.positions[t] >= cos.dims[0])
      return error(ORT_INVALID_ARGUMENT, "RotarySplitQKV: positions[" + std::to_string(t) + "] = " +
                                             std::to_string(st.positions[t]) + " outside the rotary tables' " +
                                             std::to_string(cos.dims[0]) + " positions");
  RETURN_IF_ERROR(new_output(context, 0, {T, heads, st.head_dim}, &st.q));
  RETURN_IF_ERROR(new_output(context, 1, {T, kv_heads, st.head_dim}, &st.k));
  RETURN_IF_ERROR(new_output(context, 2, {T, kv_heads, st.head_dim}, &st.v));
  if (T == 0) return nullptr;
  return parallel_for(context, rotate_rows, static_cast<size_t>((T + kRowsPerItem - 1) / kRowsPerItem), &st,
                      T * qkv.dims[1] < kSerialElements);
}

OrtStatus* create_rotary(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<RotaryKernel>(kernel, [info](RotaryKernel& k) {
    RETURN_IF_ERROR(int_attribute(info, "num_heads", &k.heads));
    return int_attribute(info, "num_kv_heads", &k.kv_heads);
  });
}

// ---- SiluAndMul ----------------------------------------------------------------------------
constexpr ONNXTensorElementDataType kSiluInputs[1] = {kF32};

struct SiluStep {
  const float* gate_up;
  float* out;
  int64_t tokens, width;   // width = I
};

// y[i] = silu(gate[i]) * up[i] for i in [begin, end), with libm's exp: the vector loops leave
// it the lanes their exp cannot take (a gate below -87, where e^gate leaves float32's normal
// range; as clamped, -3e38 came out -4.9 instead of -0: QA).
inline void silu_scalar(const float* gate, const float* up, float* y, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void silu_rows(void* user, size_t item) {
  const SiluStep& st = *static_cast<const SiluStep*>(user);
  const int64_t w = st.width;
  const int64_t end = std::min(st.tokens, static_cast<int64_t>(item + 1) * kRowsPerItem);
  for (int64_t t = static_cast<int64_t>(item) * kRowsPerItem; t < end; ++t) {
    const float* gate = st.gate_up + t * 2 * w;
    const float* up = gate + w;
    float* y = st.out + t * w;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= w; i += 16) {
      const __m512 g = _mm512_loadu_ps(gate + i);
      if (_mm512_cmp_ps_mask(g, _mm512_set1_ps(-87.0f), _CMP_LT_OQ)) {   // e^-g past exp16's clamp
        silu_scalar(gate, up, y, i, i + 16);
        continue;
      }
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
    }
#elif defined(TRTLLM_LITE_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= w; i += 8) {
      // e = e^-|g|, never past 1: silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below
      const __m256 g = _mm256_loadu_ps(gate + i);
      if (_mm256_movemask_ps(_mm256_cmp_ps(g, _mm256_set1_ps(-87.0f), _CMP_LT_OQ))) {   // e^g below exp's clamp
        silu_scalar(gate, up, y, i, i + 8);
        continue;
      }
      const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));
      const __m256 numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g);   // by g's sign bit
      _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(numerator, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    silu_scalar(gate, up, y, i, w);
  }
}

struct SiluKernel : KernelBase {
  OrtStatus* compute(OrtKernelContext* context) override;
};

OrtStatus* SiluKernel::compute(OrtKernelContext* context) {
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  if (x.dims.size() != 2 || x.dims[1] % 2 != 0)
    return error(ORT_INVALID_ARGUMENT, "SiluAndMul: gate_up " + dims_string(x.dims) + " is not [T, 2 * I]");
  SiluStep st{};
  st.tokens = x.dims[0];
  st.width = x.dims[1] / 2;
  RETURN_IF_ERROR(data_of(x, &st.gate_up));
  RETURN_IF_ERROR(new_output(context, 0, {st.tokens, st.width}, &st.out));
  if (st.tokens == 0) return nullptr;
  return parallel_for(context, silu_rows, static_cast<size_t>((st.tokens + kRowsPerItem - 1) / kRowsPerItem), &st,
                      st.tokens * st.width < kSerialElements);
}

OrtStatus* create_silu(const OrtKernelInfo*, void** kernel) {
  return new_kernel<SiluKernel>(kernel, [](SiluKernel&) { return static_cast<OrtStatus*>(nullptr); });
}

// ---- QuantizeRows --------------------------------------------------------------------------
constexpr ONNXTensorElementDataType kQuantizeRowsInputs[1] = {kF32};
constexpr ONNXTensorElementDataType kQuantizeRowsOutputs[2] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, kF32};

struct QuantizeRowsStep {
  const float* x;
  uint8_t* q;
  float* scale;
  int64_t tokens, width, planes;
};

void quantize_rows(void* user, size_t item) {
  const QuantizeRowsStep& st = *static_cast<const QuantizeRowsStep*>(user);
  const int64_t k = st.width;
  const int64_t end = std::min(st.tokens, static_cast<int64_t>(item + 1) * kRowsPerItem);
  for (int64_t t = static_cast<int64_t>(item) * kRowsPerItem; t < end; ++t) {
    const float* x = st.x + t * k;
    uint8_t* q = st.q + t * k;
    float top = 0.0f;
    bool finite = true;   // a NaN or infinity makes the row's scale NaN: the output row is NaN, as in float32
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 top16 = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (; i + 16 <= k; i += 16) {
      const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
      bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ);   // inf or NaN
      top16 = _mm512_max_ps(top16, a);
    }
    top = _mm512_reduce_max_ps(top16);
    finite = bad == 0;
#endif
    for (; i < k; ++i) {
      finite = finite && std::isfinite(x[i]);
      top = std::max(top, std::fabs(x[i]));
    }
    const float s = finite ? std::max(top * (1.0f / 127.0f), 1e-30f / 127.0f) : NAN;
    const float inv = 1.0f / s;
    st.scale[t] = s;
    uint8_t* q2 = st.planes == 2 ? st.q + (st.tokens + t) * k : nullptr;
    if (q2) st.scale[st.tokens + t] = s / 254.0f;
    i = 0;
#ifdef __AVX512F__
    // v = x * (1 / s); q = rint(v) (half to even: cvtps's default MXCSR mode), clamped to
    // [-128, 127], + 128; the second plane: rint((v - rint(v)) * 254) + 128
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (; i + 16 <= k; i += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), inv16);
      const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512i c = _mm512_cvtps_epi32(r);
      c = _mm512_min_epi32(_mm512_max_epi32(c, _mm512_set1_epi32(-128)), _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(c, _mm512_set1_epi32(128))));
      if (q2) {
        __m512i c2 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, r), _mm512_set1_ps(254.0f)));
        c2 = _mm512_min_epi32(_mm512_max_epi32(c2, _mm512_set1_epi32(-128)), _mm512_set1_epi32(127));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(c2, _mm512_set1_epi32(128))));
      }
    }
#endif
    for (; i < k; ++i) {   // |v| <= 127 (rounding may touch 127.00001: clamp)
      const float v = x[i] * inv, r = std::nearbyint(v);
      q[i] = static_cast<uint8_t>(std::min(std::max(r, -128.0f), 127.0f) + 128.0f);
      if (q2) q2[i] = static_cast<uint8_t>(std::min(std::max(std::nearbyint((v - r) * 254.0f), -128.0f), 127.0f) + 128.0f);
    }
  }
}

struct QuantizeRowsKernel : KernelBase {
  int64_t planes = 1;
  OrtStatus* compute(OrtKernelContext* context) override;
};

OrtStatus* QuantizeRowsKernel::compute(OrtKernelContext* context) {
  Tensor x;
  RETURN_IF_ERROR(read_input(context, 0, &x));
  if (x.dims.size() != 2)
    return error(ORT_INVALID_ARGUMENT, "QuantizeRows: x " + dims_string(x.dims) + " is not [T, K]");
  QuantizeRowsStep st{};
  st.tokens = x.dims[0];
  st.width = x.dims[1];
  st.planes = planes;
  RETURN_IF_ERROR(data_of(x, &st.x));
  RETURN_IF_ERROR(new_output(context, 0, {planes * st.tokens, st.width}, &st.q));
  RETURN_IF_ERROR(new_output(context, 1, {planes * st.tokens, 1}, &st.scale));
  if (st.tokens == 0) return nullptr;
  return parallel_for(context, quantize_rows, static_cast<size_t>((st.tokens + kRowsPerItem - 1) / kRowsPerItem),
                      &st, st.tokens * st.width < kSerialWork);
}

OrtStatus* read_planes(const OrtKernelInfo* info, const char* op, int64_t* planes) {
  RETURN_IF_ERROR(optional_int_attribute(info, "planes", planes));
  if (*planes != 1 && *planes != 2)
    return error(ORT_INVALID_ARGUMENT, std::string(op) + ": planes must be 1 or 2, got " + std::to_string(*planes));
  return nullptr;
}

OrtStatus* create_quantize_rows(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<QuantizeRowsKernel>(kernel, [info](QuantizeRowsKernel& k) {
    return read_planes(info, "QuantizeRows", &k.planes);
  });
}

// ---- DequantizeRows ------------------------------------------------------------------------
constexpr ONNXTensorElementDataType kDequantizeRowsInputs[3] = {kF32, kF32, kF32};

struct DequantizeRowsStep {
  const float *y, *scale, *bias;
  float* out;
  int64_t tokens, width, planes;
};

void dequantize_rows(void* user, size_t item) {
  const DequantizeRowsStep& st = *static_cast<const DequantizeRowsStep*>(user);
  const int64_t n = st.width;
  const int64_t end = std::min(st.tokens, static_cast<int64_t>(item + 1) * kRowsPerItem);
  for (int64_t t = static_cast<int64_t>(item) * kRowsPerItem; t < end; ++t) {
    const float* y0 = st.y + t * n;
    const float* bias = st.bias;
    const float s0 = st.scale[t];
    float* out = st.out + t * n;
    if (st.planes == 1) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] = y0[i] * s0 + bias[i];
      continue;
    }
    const float* y1 = st.y + (st.tokens + t) * n;
    const float s1 = st.scale[st.tokens + t];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = y0[i] * s0 + (y1[i] * s1 + bias[i]);
  }
}

struct DequantizeRowsKernel : KernelBase {
  int64_t planes = 1;
  OrtStatus* compute(OrtKernelContext* context) override;
};

OrtStatus* DequantizeRowsKernel::compute(OrtKernelContext* context) {
  Tensor y, scale, bias;
  RETURN_IF_ERROR(read_inputs(context, &y, &scale, &bias));
  if (y.dims.size() != 2 || y.dims[0] % planes || scale.dims.size() != 2 || scale.dims[0] != y.dims[0] ||
      scale.dims[1] != 1 || bias.dims.size() != 1 || bias.dims[0] != y.dims[1])
    return error(ORT_INVALID_ARGUMENT, "DequantizeRows: y " + dims_string(y.dims) + ", scale " +
                                           dims_string(scale.dims) + " and bias " + dims_string(bias.dims) +
                                           " are not [" + std::to_string(planes) + " T, N], [" +
                                           std::to_string(planes) + " T, 1] and [N]");
  DequantizeRowsStep st{};
  st.planes = planes;
  st.tokens = y.dims[0] / planes;
  st.width = y.dims[1];
  RETURN_IF_ERROR(data_of(y, &st.y));
  RETURN_IF_ERROR(data_of(scale, &st.scale));
  RETURN_IF_ERROR(data_of(bias, &st.bias));
  RETURN_IF_ERROR(new_output(context, 0, {st.tokens, st.width}, &st.out));
  if (st.tokens == 0) return nullptr;
  return parallel_for(context, dequantize_rows, static_cast<size_t>((st.tokens + kRowsPerItem - 1) / kRowsPerItem),
                      &st, planes * st.tokens * st.width < kSerialWork);
}

OrtStatus* create_dequantize_rows(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<DequantizeRowsKernel>(kernel, [info](DequantizeRowsKernel& k) {
    return read_planes(info, "DequantizeRows", &k.planes);
  });
}

// ---- BlockHadamard -------------------------------------------------------------------------
constexpr ONNXTensorElementDataType kBlockHadamardInputs[2] = {kF32, kF32};

struct BlockHadamardStep {
  const float* x;
  float* out;
  int64_t tokens, width, block;
};

// x [b] <- x H_b * sqrt(b) in place (the unnormalized fast Walsh-Hadamard transform, Sylvester
// order: stage h pairs element i with i + h for i's bit h clear: (a, c) -> (a + c, a - c)).
inline void fwht(float* x, int64_t b) {
  int64_t h = 1;
#ifdef __AVX512F__
  if (b >= 16) {   // stages 1, 2, 4, 8 within each 16-float vector: lane i takes lane i ^ h
    const __m512i idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i partner[4];
    __m512 sign[4];
    for (int s = 0; s < 4; ++s) {
      const __m512i bit = _mm512_set1_epi32(1 << s);
      partner[s] = _mm512_xor_si512(idx, bit);
      // +1 where lane i has bit s clear (a + c), -1 where set (a - c: -x[i] + x[i ^ h])
      const __mmask16 set = _mm512_test_epi32_mask(idx, bit);
      sign[s] = _mm512_mask_blend_ps(set, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
    }
    for (int64_t i = 0; i < b; i += 16) {
      __m512 v = _mm512_loadu_ps(x + i);
      for (int s = 0; s < 4; ++s) v = _mm512_fmadd_ps(sign[s], v, _mm512_permutexvar_ps(partner[s], v));
      _mm512_storeu_ps(x + i, v);
    }
    h = 16;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (b >= 8) {   // stages 1, 2, 4 within each 8-float vector, the same way
    const __m256i idx = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    __m256i partner[3];
    __m256 sign[3];
    for (int s = 0; s < 3; ++s) {
      const __m256i bit = _mm256_set1_epi32(1 << s);
      partner[s] = _mm256_xor_si256(idx, bit);
      const __m256 set = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(idx, bit), bit));
      sign[s] = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(-1.0f), set);
    }
    for (int64_t i = 0; i < b; i += 8) {
      __m256 v = _mm256_loadu_ps(x + i);
      for (int s = 0; s < 3; ++s) v = _mm256_fmadd_ps(sign[s], v, _mm256_permutevar8x32_ps(v, partner[s]));
      _mm256_storeu_ps(x + i, v);
    }
    h = 8;
  }
#endif
  for (; h < b; h *= 2)
    for (int64_t i = 0; i < b; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], c = x[j + h];
        x[j] = a + c;
        x[j + h] = a - c;
      }
}

void block_hadamard_rows(void* user, size_t item) {
  const BlockHadamardStep& st = *static_cast<const BlockHadamardStep*>(user);
  const int64_t end = std::min(st.tokens, static_cast<int64_t>(item + 1) * kRowsPerItem);
  const float norm = 1.0f / std::sqrt(static_cast<float>(st.block));
  for (int64_t t = static_cast<int64_t>(item) * kRowsPerItem; t < end; ++t) {
    float* y = st.out + t * st.width;
    const float* x = st.x + t * st.width;
    for (int64_t i = 0; i < st.width; ++i) y[i] = x[i] * norm;   // scaled first: the sums stay in x's range
    for (int64_t i = 0; i < st.width; i += st.block) fwht(y + i, st.block);
  }
}

struct BlockHadamardKernel : KernelBase {
  OrtStatus* compute(OrtKernelContext* context) override;
  std::atomic<const float*> checked{nullptr};   // the matrix last found to be H_b (an initializer: once)
};

// Whether h [b, b] is H_b: entry (i, j) = (-1)^popcount(i & j) / sqrt(b), to float32 rounding
// (the kernel computes that transform; any other matrix would make it disagree with the body).
bool is_sylvester_hadamard(const float* h, int64_t b) {
  const float norm = 1.0f / std::sqrt(static_cast<float>(b));
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < b; ++j) {
      const float want = (__builtin_popcountll(static_cast<uint64_t>(i & j)) & 1) ? -norm : norm;
      if (!(std::fabs(h[i * b + j] - want) <= 1e-5f * norm)) return false;
    }
  return true;
}

OrtStatus* BlockHadamardKernel::compute(OrtKernelContext* context) {
  Tensor x, h;
  RETURN_IF_ERROR(read_inputs(context, &x, &h));
  if (x.dims.size() != 2)
    return error(ORT_INVALID_ARGUMENT, "BlockHadamard: x " + dims_string(x.dims) + " is not [T, K]");
  const bool square = h.dims.size() == 2 && h.dims[0] == h.dims[1];
  const int64_t b = square ? h.dims[0] : 0;
  if (b < 1 || (b & (b - 1)) != 0 || x.dims[1] % b != 0)
    return error(ORT_INVALID_ARGUMENT, "BlockHadamard: hadamard " + dims_string(h.dims) +
                                           " is not [b, b] with b a power of two dividing K = " +
                                           std::to_string(x.dims[1]));
  const float* matrix = nullptr;
  RETURN_IF_ERROR(data_of(h, &matrix));
  if (checked.load(std::memory_order_acquire) != matrix) {
    if (!is_sylvester_hadamard(matrix, b))
      return error(ORT_INVALID_ARGUMENT, "BlockHadamard: hadamard is not the normalized Sylvester Hadamard matrix "
                                         "of size " + std::to_string(b) + " (builder.rotation.hadamard_matrix)");
    checked.store(matrix, std::memory_order_release);
  }
  BlockHadamardStep st{};
  st.tokens = x.dims[0];
  st.width = x.dims[1];
  st.block = b;
  RETURN_IF_ERROR(data_of(x, &st.x));
  RETURN_IF_ERROR(new_output(context, 0, {st.tokens, st.width}, &st.out));
  if (st.tokens == 0) return nullptr;
  return parallel_for(context, block_hadamard_rows, static_cast<size_t>((st.tokens + kRowsPerItem - 1) / kRowsPerItem),
                      &st, st.tokens * st.width < kSerialWork);
}

OrtStatus* create_block_hadamard(const OrtKernelInfo*, void** kernel) {
  return new_kernel<BlockHadamardKernel>(kernel, [](BlockHadamardKernel&) { return static_cast<OrtStatus*>(nullptr); });
}

}  // namespace

const OrtCustomOp* block_hadamard_op() {
  static const CustomOp op({"BlockHadamard", kBlockHadamardInputs, 2, 1, create_block_hadamard});
  return &op;
}

const OrtCustomOp* dequantize_rows_op() {
  static const CustomOp op({"DequantizeRows", kDequantizeRowsInputs, 3, 1, create_dequantize_rows});
  return &op;
}

const OrtCustomOp* quantize_rows_op() {
  static const CustomOp op({"QuantizeRows", kQuantizeRowsInputs, 1, 2, create_quantize_rows, SIZE_MAX,
                            kQuantizeRowsOutputs});
  return &op;
}

KernelBase* new_rotary_split_qkv(int64_t num_heads, int64_t num_kv_heads) {
  RotaryKernel* k = new RotaryKernel();
  k->heads = num_heads;
  k->kv_heads = num_kv_heads;
  return k;
}

KernelBase* new_silu_and_mul() { return new SiluKernel(); }

// ---- SkipRMSNorm ---------------------------------------------------------------------------
namespace {

constexpr ONNXTensorElementDataType kSkipNormInputs[3] = {kF32, kF32, kF32};
constexpr int64_t kNormRowsPerItem = 16, kNormRowsInterleaved = 8;

// Holds v in a register the compiler cannot see into, so v * v is rounded before the add that
// takes it (no FMA contraction: ONNX Runtime's build rounds it), at no cost.
inline void keep_rounded(float& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  asm("" : "+m"(v));
#endif
}

// A row's squares must be added one after another (ONNX Runtime's order, for its bits), a chain
// of dependent adds (~4 cycles each) that left the core idle: kNormRowsInterleaved rows' chains
// run side by side instead (64 rows of 576: 35 -> 15 us on one Zen 4 core, the same bits).
void norm_rows(void* user, size_t item) {
  const NormStep& st = *static_cast<const NormStep*>(user);
  const int64_t w = st.width, end = std::min(st.rows, static_cast<int64_t>(item + 1) * kNormRowsPerItem);
  for (int64_t r0 = static_cast<int64_t>(item) * kNormRowsPerItem; r0 < end; r0 += kNormRowsInterleaved) {
    const int64_t g = std::min(kNormRowsInterleaved, end - r0);
    const float* rows[kNormRowsInterleaved];
    float squares[kNormRowsInterleaved] = {};
    for (int64_t j = 0; j < g; ++j) {
      const float *a = st.a + (r0 + j) * w, *b = st.b + (r0 + j) * w;
      float* sum = st.sum + (r0 + j) * w;
      for (int64_t i = 0; i < w; ++i) sum[i] = a[i] + b[i];
      rows[j] = sum;
    }
    if (g == kNormRowsInterleaved) {
      for (int64_t i = 0; i < w; ++i)
        for (int64_t j = 0; j < kNormRowsInterleaved; ++j) {
          float square = rows[j][i] * rows[j][i];
          keep_rounded(square);
          squares[j] += square;
        }
    } else {
      for (int64_t j = 0; j < g; ++j)
        for (int64_t i = 0; i < w; ++i) {
          float square = rows[j][i] * rows[j][i];
          keep_rounded(square);
          squares[j] += square;
        }
    }
    for (int64_t j = 0; j < g; ++j) {
      const float rms = std::sqrt(squares[j] / static_cast<float>(w) + st.epsilon);
      float* out = st.out + (r0 + j) * w;
      for (int64_t i = 0; i < w; ++i) out[i] = rows[j][i] / rms * st.gamma[i];
    }
  }
}

struct SkipNormKernel : KernelBase {
  float epsilon = 1e-6f;
  OrtStatus* compute(OrtKernelContext* context) override;
};

OrtStatus* SkipNormKernel::compute(OrtKernelContext* context) {
  Tensor a, b, gamma;
  RETURN_IF_ERROR(read_inputs(context, &a, &b, &gamma));
  if (a.dims.size() != 2 || a.dims != b.dims || gamma.dims.size() != 1 || gamma.dims[0] != a.dims[1])
    return error(ORT_INVALID_ARGUMENT, "SkipRMSNorm: input " + dims_string(a.dims) + ", skip " + dims_string(b.dims) +
                                           ", gamma " + dims_string(gamma.dims) + " are not [T, H], [T, H], [H]");
  NormStep st{};
  st.rows = a.dims[0];
  st.width = a.dims[1];
  st.epsilon = epsilon;
  RETURN_IF_ERROR(data_of(a, &st.a));
  RETURN_IF_ERROR(data_of(b, &st.b));
  RETURN_IF_ERROR(data_of(gamma, &st.gamma));
  RETURN_IF_ERROR(new_output(context, 0, {st.rows, st.width}, &st.out));
  RETURN_IF_ERROR(new_output(context, 1, {st.rows, st.width}, &st.sum));
  return skip_norm(context, st);
}

OrtStatus* create_skip_norm(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<SkipNormKernel>(kernel, [info](SkipNormKernel& k) {
    return float_attribute(info, "epsilon", &k.epsilon);
  });
}

}  // namespace

// Two items or more go to the pool: a norm's rows are more work than kSerialWork's multiply-adds
// (64 rows of 576 through 30 chained nodes, 2 threads: 16.2 us a node inline, 11.3 split).
OrtStatus* skip_norm(OrtKernelContext* context, NormStep& st) {
  if (st.rows == 0) return nullptr;
  return parallel_for(context, norm_rows, static_cast<size_t>((st.rows + kNormRowsPerItem - 1) / kNormRowsPerItem),
                      &st, st.rows <= kNormRowsPerItem);
}

const OrtCustomOp* skip_rms_norm_op() {
  static const CustomOp op({"SkipRMSNorm", kSkipNormInputs, 3, 2, create_skip_norm});
  return &op;
}

const OrtCustomOp* rotary_split_qkv_op() {
  static const CustomOp op({"RotarySplitQKV", kRotaryInputs, 4, 3, create_rotary});
  return &op;
}

const OrtCustomOp* silu_and_mul_op() {
  static const CustomOp op({"SiluAndMul", kSiluInputs, 1, 1, create_silu});
  return &op;
}

}  // namespace trtllm_lite_kernels
