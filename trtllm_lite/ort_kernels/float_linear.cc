// trtllm_lite::FloatLinear: a float32 linear layer over a weight stored in 32-row panels, one
// node where a float32 engine's kernels graph had Gemm(x, W, transB=1)
// (builder/fused_ops.py use_float_linears writes it and the panels):
//
//   inputs   x [M, K] float32, panels [ceil(N / 32), K, 32] float32
//            (panels[p, k, j] = W[32 p + j, k]; 0 for rows past N)
//   attrs    N, K
//   output   y [M, N] float32,  y[m, n] = sum_k x[m, k] W[n, k]
//
// Why not ONNX Runtime's Gemm: at batch 1 a decode step streams every weight once, and MLAS's
// SGEMM on its prepacked B read SmolLM2's 121 float32 weights (538 MB) at ~29 GB/s on a 2-core
// Xeon VM where a read of the same bytes ran at ~34 (14.8 GB/s on one core against this loop's
// ~17): 81-83% of the bandwidth bound a step. The panels are laid out for both ends:
//
//   M = 1 (memory-bound): each work item is one panel, read front to back as two streams (its
//     first and second halves of K, summed at the end) with software prefetch 1 KiB ahead in
//     each: one 64-byte vector of 16 rows per column, multiplied by x[k] broadcast. 538 MB in
//     ~15 ms (~36 GB/s) on that VM, against MLAS's ~19 ms.
//   M > 1 (compute-bound as M grows): register tiles of up to 6 rows of x x 64 outputs (two
//     panels, 24 accumulators; per column four vector loads, 6 broadcasts, 24 FMAs; an odd
//     panel count's last panel alone, up to 14 rows x 32), over blocks of x's rows that stay in
//     L2 (kBlockBytes) while the panels go by. A work item is a group of two panels over a part
//     of the block's rows (where there are few groups, their rows split so each core gets at
//     least kItemsPerCore items: N = 576's 9 groups went 5 / 4 over two cores); its first tile
//     brings the panels in (prefetched), the rest read them from L2. Chains of SmolLM2's 120
//     layer GEMMs through ONNX Runtime on that VM: 269 / 315 / 333 GFLOP/s at M = 64 / 256 /
//     512, against MLAS's 268-290 / 332-374 / 343-355.
//
// Each output is one float32 sum over k in a fixed order for a given M (the summation order
// differs from MLAS's, so results agree to float32 rounding, not bit for bit). Work is handed
// out as one contiguous range of items per core. Without AVX-512 the same layout runs a
// portable loop (correct everywhere; the runtime picks these graphs only on AVX-512 CPUs).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "kernel_common.h"

namespace trtllm_lite_kernels {
namespace {

constexpr int64_t kPanel = 32;          // weight rows per panel (two 16-float vectors)
constexpr int kTileRows = 14;           // rows of x per register tile over one panel (M > 1)
constexpr int kPairRows = 6;            // and over two panels (a group's: 64 outputs)
constexpr int64_t kGroupPanels = 2;     // panels per work item (M > 1)
constexpr int64_t kItemsPerCore = 16;   // M > 1: at least this many work items a core, where rows allow
constexpr int64_t kPrefetchBytes = 1024;   // the loops' software prefetch distance, per stream
constexpr int64_t kBlockBytes = 512 << 10;   // x's rows a pass over the panels takes (M > 1): ~half an L2

struct Step {
  const float* x = nullptr;   // [M, K]
  const float* panels = nullptr;
  float* y = nullptr;         // [M, N]
  int64_t m = 0, n = 0, k = 0;
  int64_t row_parts = 1;      // M > 1: each group's rows in this many work items (the tiles' rows apart)
};

// Rows [0, ROWS) of x (row stride k_len) times PANELS adjacent panels (32 PANELS outputs) into
// out (row stride ldo): ROWS x 2 PANELS accumulators; per column 2 PANELS vector loads, ROWS
// broadcasts and 2 PANELS ROWS FMAs.
#ifdef __AVX512F__
template <int ROWS, int PANELS, bool PREFETCH>
void tile(const float* panels, const float* x, int64_t k_len, float* out, int64_t ldo) {
  constexpr int V = 2 * PANELS;   // vectors a column
  __m512 acc[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const int64_t stride = k_len * kPanel;   // from one panel to the next
  for (int64_t k = 0; k < k_len; ++k) {
    __m512 w[V];
    for (int q = 0; q < PANELS; ++q) {
      const float* col = panels + q * stride + k * kPanel;
      if (PREFETCH) {
        _mm_prefetch(reinterpret_cast<const char*>(col) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(col) + kPrefetchBytes + 64, _MM_HINT_T0);
      }
      w[2 * q] = _mm512_loadu_ps(col);
      w[2 * q + 1] = _mm512_loadu_ps(col + 16);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * k_len + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(w[v], b, acc[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + r * ldo + 16 * v, acc[r][v]);
}

using TileFn = void (*)(const float*, const float*, int64_t, float*, int64_t);

// tiles[panels - 1][prefetch][rows]: two panels take up to kPairRows rows (24 accumulators), a
// lone panel (an odd panel count's last) up to kTileRows (28)
template <int PANELS, bool PREFETCH, int... ROWS>
constexpr std::array<TileFn, kTileRows + 1> tiles_of(std::integer_sequence<int, 0, ROWS...>) {
  return {nullptr, tile<ROWS, PANELS, PREFETCH>...};
}
using Rows = std::make_integer_sequence<int, kTileRows + 1>;
using PairRows = std::make_integer_sequence<int, kPairRows + 1>;
template <int PANELS, bool PREFETCH>
constexpr auto table() {
  if constexpr (PANELS == 1) {
    return tiles_of<1, PREFETCH>(Rows{});
  } else {
    return tiles_of<2, PREFETCH>(PairRows{});
  }
}
const std::array<TileFn, kTileRows + 1> kTiles[2][2] = {{table<1, false>(), table<1, true>()},
                                                       {table<2, false>(), table<2, true>()}};

// M = 1: the panel as two streams (K's halves), 32 outputs into out.
void gemv_panel(const float* panel, const float* x, int64_t k_len, float* out) {
  const int64_t half = k_len / 2;
  const float* second = panel + half * kPanel;
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  for (int64_t k = 0; k < half; ++k) {
    const float* w = panel + k * kPanel;
    const float* v = second + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[half + k]);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w), x0, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 16), x0, a1);
    b0 = _mm512_fmadd_ps(_mm512_loadu_ps(v), x1, b0);
    b1 = _mm512_fmadd_ps(_mm512_loadu_ps(v + 16), x1, b1);
  }
  for (int64_t k = 2 * half; k < k_len; ++k) {   // (odd K: the last column)
    const __m512 x0 = _mm512_set1_ps(x[k]);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(panel + k * kPanel), x0, a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(panel + k * kPanel + 16), x0, a1);
  }
  _mm512_storeu_ps(out, _mm512_add_ps(a0, b0));
  _mm512_storeu_ps(out + 16, _mm512_add_ps(a1, b1));
}
#else
// Portable: rows [0, rows) of x times the panel.
void tile_portable(const float* panel, const float* x, int64_t k_len, int rows, float* out, int64_t ldo) {
  for (int r = 0; r < rows; ++r) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < k_len; ++k) {
      const float b = x[r * k_len + k];
      const float* w = panel + k * kPanel;
      for (int64_t j = 0; j < kPanel; ++j) acc[j] += w[j] * b;
    }
    std::memcpy(out + r * ldo, acc, sizeof acc);
  }
}
#endif

// Batch 1's work item: panel p.
void run_gemv_panel(void* user, size_t item) {
  const Step& st = *static_cast<const Step*>(user);
  const int64_t p = static_cast<int64_t>(item);
  const int64_t col = p * kPanel, width = std::min(kPanel, st.n - col);
  float edge[kPanel];
  float* out = width == kPanel ? st.y + col : edge;   // (an N that is not a multiple of 32: its last panel)
#ifdef __AVX512F__
  gemv_panel(st.panels + p * st.k * kPanel, st.x, st.k, out);
#else
  tile_portable(st.panels + p * st.k * kPanel, st.x, st.k, 1, out, kPanel);
#endif
  if (out == edge) std::memcpy(st.y + col, edge, sizeof(float) * width);
}

// M > 1's work item: group g of kGroupPanels panels (an odd count's last group: one) over one
// of the row_parts parts of x's rows; the part's first tile brings the panels in (prefetched),
// the rest read them from L2.
void run_group(void* user, size_t item) {
  const Step& st = *static_cast<const Step*>(user);
  const int64_t num_panels = (st.n + kPanel - 1) / kPanel;
  const int64_t part = static_cast<int64_t>(item) % st.row_parts;
  const int64_t p = static_cast<int64_t>(item) / st.row_parts * kGroupPanels;
  const int panels = static_cast<int>(std::min(kGroupPanels, num_panels - p));
  const int64_t col = p * kPanel, width = std::min(panels * kPanel, st.n - col), group_width = panels * kPanel;
  const bool whole = width == group_width;   // (the last panel of an N that is not a multiple of 32: a buffer first)
  const int most = panels == 2 ? kPairRows : kTileRows;
  float edge[kTileRows * kPanel];   // (>= kPairRows x 64)
  const int64_t tiles = (st.m + most - 1) / most;   // the part's rows: whole tiles, split evenly
  const int64_t first = tiles * part / st.row_parts * most, last = std::min(st.m, tiles * (part + 1) / st.row_parts * most);
  for (int64_t r0 = first; r0 < last; r0 += most) {
    const int rows = static_cast<int>(std::min<int64_t>(most, last - r0));
    float* out = whole ? st.y + r0 * st.n + col : edge;
    const int64_t ldo = whole ? st.n : group_width;
    const float* panel = st.panels + p * st.k * kPanel;
#ifdef __AVX512F__
    kTiles[panels - 1][r0 == first][rows](panel, st.x + r0 * st.k, st.k, out, ldo);
#else
    for (int q = 0; q < panels; ++q)
      tile_portable(panel + q * st.k * kPanel, st.x + r0 * st.k, st.k, rows, out + q * kPanel, ldo);
#endif
    if (!whole)
      for (int r = 0; r < rows; ++r)
        std::memcpy(st.y + (r0 + r) * st.n + col, edge + r * group_width, sizeof(float) * width);
  }
}

struct Kernel : KernelBase {
  int64_t n = 0, k = 0;
  std::string description() const {
    return "FloatLinear (N " + std::to_string(n) + ", K " + std::to_string(k) + ")";
  }
  OrtStatus* compute(OrtKernelContext* context) override {
    Tensor x, panels;
    RETURN_IF_ERROR(read_inputs(context, &x, &panels));
    const int64_t num_panels = (n + kPanel - 1) / kPanel;
    if (x.dims.size() != 2 || x.dims[1] != k)
      return error(ORT_INVALID_ARGUMENT, description() + ": x " + dims_string(x.dims) + " is not [M, K]");
    if (panels.dims != Dims{num_panels, k, kPanel})
      return error(ORT_INVALID_ARGUMENT, description() + ": panels " + dims_string(panels.dims) + " is not [" +
                                             std::to_string(num_panels) + ", " + std::to_string(k) + ", 32]");
    Step st;
    st.m = x.dims[0];
    st.n = n;
    st.k = k;
    RETURN_IF_ERROR(data_of(x, &st.x));
    RETURN_IF_ERROR(data_of(panels, &st.panels));
    RETURN_IF_ERROR(new_output(context, 0, {st.m, n}, &st.y));
    if (st.m == 0 || n == 0) return nullptr;
    if (k == 0) {
      std::fill(st.y, st.y + st.m * n, 0.0f);
      return nullptr;
    }
    if (st.m == 1)   // one contiguous range of panels per core (one thread below kSerialWork multiply-adds)
      return parallel_for(context, run_gemv_panel, static_cast<size_t>(num_panels), &st, n * k < kSerialWork,
                          std::min(static_cast<size_t>(num_panels), available_cores()));
    // blocks of rows whose x stays in L2 while every panel goes by (a prompt chunk's x, 2,048
    // x 576 floats, is 4.7 MB: read again for each panel, it cost SmolLM2 ~15% of a 2,048-token
    // prompt); per block one contiguous range of panels per core, one thread below kSerialWork
    // multiply-adds
    constexpr int64_t kRowsUnit = kTileRows * kPairRows / 2;   // (42: whole tiles of both kinds)
    const int64_t block_rows = std::max<int64_t>(kRowsUnit, kBlockBytes / (4 * k) / kRowsUnit * kRowsUnit);
    const float* x_all = st.x;
    float* y_all = st.y;
    const int64_t rows = st.m;
    // few groups (N = 576: 9) split 5 / 4 over two cores lost ~10% of those linears: then each
    // group's rows are parts of their own, for at least kItemsPerCore items a core
    const int64_t groups = (num_panels + kGroupPanels - 1) / kGroupPanels;
    const int64_t wanted = kItemsPerCore * static_cast<int64_t>(available_cores());
    for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
      st.m = std::min(block_rows, rows - r0);
      st.x = x_all + r0 * k;
      st.y = y_all + r0 * n;
      st.row_parts = std::max<int64_t>(1, std::min((wanted + groups - 1) / groups, (st.m + kPairRows - 1) / kPairRows));
      const size_t items = static_cast<size_t>(groups * st.row_parts);
      RETURN_IF_ERROR(parallel_for(context, run_group, items, &st, st.m * n * k < kSerialWork,
                                   std::min(items, available_cores())));
    }
    return nullptr;
  }
};

OrtStatus* create_kernel(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<Kernel>(kernel, [info](Kernel& kern) {
    RETURN_IF_ERROR(int_attribute(info, "N", &kern.n));
    RETURN_IF_ERROR(int_attribute(info, "K", &kern.k));
    if (kern.n < 0 || kern.k < 0)
      return error(ORT_INVALID_ARGUMENT, "FloatLinear: N and K must be >= 0, got N " + std::to_string(kern.n) +
                                             ", K " + std::to_string(kern.k));
    return static_cast<OrtStatus*>(nullptr);
  });
}

constexpr ONNXTensorElementDataType kInputs[2] = {kF32, kF32};

}  // namespace

KernelBase* new_float_linear(int64_t n, int64_t k) {
  Kernel* kernel = new Kernel();
  kernel->n = n;
  kernel->k = k;
  return kernel;
}

const OrtCustomOp* float_linear_op() {
  static const CustomOp op({"FloatLinear", kInputs, 2, 1, create_kernel});
  return &op;
}

}  // namespace trtllm_lite_kernels
