// trtllm_lite::AddBlockOffsets: the float offsets of block-quantized weights (GGUF Q4_1's block
// mins, split 8-bit halves), added to a MatMulNBits output.
//
// A block-quantized weight row n dequantizes as w[n, k] = scale[n, b] * q[n, k] + offset[n, b]
// for k in block b (block_size columns). MatMulNBits computes the scale * q part; the offsets
// contribute sum_b offset[n, b] * (sum of x over block b):
//
//   inputs   y [M, N] float32 (MatMulNBits' output), x [M, K] float32 (its input),
//            offsets [N, nb] float32 for x's first nb blocks (nb * block_size <= K: the split
//            8-bit form's x is [x, x]), block_sum_matrix [K, nb] (0/1; read only by the ONNX
//            function body, builder/fused_ops.py)
//   attr     block_size (int)
//   output   y + blocksum(x) @ offsets^T   [M, N] float32
//
// One node and one pass where the function body takes a MatMul (the block sums) and a Gemm:
// at batch 1 those are two of a linear's three ONNX Runtime nodes, each mostly per-node cost.
#include <cstdint>
#include <mutex>

#include "kernel_common.h"

namespace trtllm_lite_kernels {
namespace {

constexpr ONNXTensorElementDataType kInputs[4] = {kF32, kF32, kF32, kF32};
constexpr int64_t kRows = 4;        // rows of x per register tile
constexpr int64_t kColumns = 64;    // output columns per register tile (4 x 16 lanes)
constexpr int64_t kColumnsPerItem = 512;

struct Step {
  const float *y, *x, *offsets_t;   // offsets_t [nb, N] float32 ...
  const uint16_t* offsets_t_half;   // ... or float16 bits, where every offset is exact in float16
  float *out, *sums;                // sums [M, nb]
  int64_t rows, n, k, nb, block_size;
};

void block_sums(void* user, size_t row) {
  const Step& st = *static_cast<const Step*>(user);
  const float* x = st.x + static_cast<int64_t>(row) * st.k;
  float* sums = st.sums + static_cast<int64_t>(row) * st.nb;
  for (int64_t b = 0; b < st.nb; ++b) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < st.block_size; ++i) total += x[b * st.block_size + i];
    sums[b] = total;
  }
}

// out[r, c] = y[r, c] + sum_b sums[r, b] * offsets_t[b, c] for rows [r0, r0 + R) and a column range.
void add_offsets(const Step& st, int64_t r0, int64_t rows, int64_t c0, int64_t c1) {
#ifdef __AVX512F__
  for (int64_t c = c0; c < c1; c += kColumns) {
    const int64_t width = std::min(kColumns, c1 - c);
    __mmask16 mask[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t lanes = std::max<int64_t>(0, std::min<int64_t>(16, width - 16 * v));
      mask[v] = static_cast<__mmask16>((1u << lanes) - 1);
    }
    __m512 acc[kRows][4];
    for (int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_maskz_loadu_ps(mask[v], st.y + (r0 + r) * st.n + c + 16 * v);
    for (int64_t b = 0; b < st.nb; ++b) {
      __m512 o[4];
      if (st.offsets_t_half) {   // GGUF Q4_1 mins are float16: half the bytes to stream
        const uint16_t* row = st.offsets_t_half + b * st.n + c;
        for (int v = 0; v < 4; ++v) o[v] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask[v], row + 16 * v));
      } else {
        for (int v = 0; v < 4; ++v) o[v] = _mm512_maskz_loadu_ps(mask[v], st.offsets_t + b * st.n + c + 16 * v);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 s = _mm512_set1_ps(st.sums[(r0 + r) * st.nb + b]);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(s, o[v], acc[r][v]);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(st.out + (r0 + r) * st.n + c + 16 * v, mask[v], acc[r][v]);
  }
#else
  for (int64_t r = r0; r < r0 + rows; ++r) {
    float* out = st.out + r * st.n;
    for (int64_t c = c0; c < c1; ++c) out[c] = st.y[r * st.n + c];
    for (int64_t b = 0; b < st.nb; ++b) {
      const float s = st.sums[r * st.nb + b];
      const float* o = st.offsets_t + b * st.n;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) out[c] += s * o[c];
    }
  }
#endif
}

// Work item: a block of kRows rows x kColumnsPerItem columns.
void add_offsets_item(void* user, size_t item) {
  const Step& st = *static_cast<const Step*>(user);
  const int64_t column_items = (st.n + kColumnsPerItem - 1) / kColumnsPerItem;
  const int64_t r0 = static_cast<int64_t>(item) / column_items * kRows;
  const int64_t c0 = static_cast<int64_t>(item) % column_items * kColumnsPerItem;
  add_offsets(st, r0, std::min(kRows, st.rows - r0), c0, std::min(st.n, c0 + kColumnsPerItem));
}

struct Kernel : KernelBase {
  int64_t block_size = 0;
  std::mutex mutex;
  const float* offsets_seen = nullptr;    // the offsets tensor offsets_t was made from
  std::vector<float> offsets_t;           // [nb, N]: a row of offsets per block, for the tiles
  std::vector<uint16_t> offsets_t_half;   // the same in float16 when that is exact (GGUF's mins)
  OrtStatus* compute(OrtKernelContext* context) override;
};

OrtStatus* Kernel::compute(OrtKernelContext* context) {
  Tensor y, x, offsets;
  RETURN_IF_ERROR(read_inputs(context, &y, &x, &offsets));
  if (y.dims.size() != 2 || x.dims.size() != 2 || offsets.dims.size() != 2 || y.dims[0] != x.dims[0] ||
      offsets.dims[0] != y.dims[1] || block_size <= 0 || x.dims[1] < offsets.dims[1] * block_size)
    return error(ORT_INVALID_ARGUMENT, "AddBlockOffsets: y " + dims_string(y.dims) + ", x " + dims_string(x.dims) +
                                           " and offsets " + dims_string(offsets.dims) +
                                           " are not [M, N], [M, >= nb * " + std::to_string(block_size) + "], [N, nb]");
  Step st{};
  st.rows = y.dims[0];
  st.n = y.dims[1];
  st.k = x.dims[1];
  st.nb = offsets.dims[1];
  st.block_size = block_size;
  const float* offsets_data = nullptr;
  RETURN_IF_ERROR(data_of(y, &st.y));
  RETURN_IF_ERROR(data_of(x, &st.x));
  RETURN_IF_ERROR(data_of(offsets, &offsets_data));
  {
    std::lock_guard<std::mutex> lock(mutex);   // offsets are a constant: transposed once
    if (offsets_seen != offsets_data) {
      offsets_t.resize(static_cast<size_t>(st.nb * st.n));
      for (int64_t n = 0; n < st.n; ++n)
        for (int64_t b = 0; b < st.nb; ++b) offsets_t[b * st.n + n] = offsets_data[n * st.nb + b];
      offsets_t_half.clear();
#ifdef __AVX512F__
      std::vector<uint16_t> half(offsets_t.size());
      bool exact = true;
      for (size_t i = 0; i < half.size() && exact; ++i) exact = float_to_half_exact(offsets_t[i], &half[i]);
      if (exact) {
        offsets_t_half = std::move(half);
        std::vector<float>().swap(offsets_t);
      }
#endif
      offsets_seen = offsets_data;
    }
  }
  st.offsets_t = offsets_t.data();
  st.offsets_t_half = offsets_t_half.empty() ? nullptr : offsets_t_half.data();
  RETURN_IF_ERROR(new_output(context, 0, {st.rows, st.n}, &st.out));
  if (st.rows == 0) return nullptr;
  thread_local std::vector<float> sums;
  sums.resize(static_cast<size_t>(st.rows * st.nb));
  st.sums = sums.data();
  // the offsets are the bulk of the bytes at batch 1: two threads stream them faster
  // than one from 64 KiB on, and the multiply-adds need both from kSerialWork on
  const bool serial = st.rows * st.n * st.nb < kSerialWork && st.n * st.nb * 2 < (64 << 10);
  RETURN_IF_ERROR(parallel_for(context, block_sums, static_cast<size_t>(st.rows), &st, serial));
  const int64_t items = (st.rows + kRows - 1) / kRows * ((st.n + kColumnsPerItem - 1) / kColumnsPerItem);
  return parallel_for(context, add_offsets_item, static_cast<size_t>(items), &st, serial);
}

OrtStatus* create_kernel(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<Kernel>(kernel, [info](Kernel& k) { return int_attribute(info, "block_size", &k.block_size); });
}

}  // namespace

const OrtCustomOp* add_block_offsets_op() {
  static const CustomOp op({"AddBlockOffsets", kInputs, 4, 1, create_kernel});
  return &op;
}

}  // namespace trtllm_lite_kernels
