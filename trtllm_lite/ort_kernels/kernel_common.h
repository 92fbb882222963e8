// Helpers shared by trtllm-lite's ONNX Runtime CPU kernels: the API table, errors, inputs,
// and a vectorizable exp.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// The AVX2 loops (CPUs without AVX-512: AMD Zen 1-3, Intel client cores) need FMA and F16C too;
// an AVX-512 build takes its own loops.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TRTLLM_LITE_AVX2 1
#endif

#include "ort_abi.h"

// The library is one unit built with one set of flags, and its 32-byte GCC vectors only pass
// between inline functions: GCC's note that their ABI differs without AVX does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace trtllm_lite_kernels {

using namespace ort_abi;

// The OrtApi table, set by RegisterCustomOps (register.cc) before any kernel runs.
extern const OrtApi* g_api;

constexpr ONNXTensorElementDataType kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ONNXTensorElementDataType kI64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr ONNXTensorElementDataType kBool = ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
constexpr ONNXTensorElementDataType kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr ONNXTensorElementDataType kAnyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;   // checked by the kernel

#define RETURN_IF_ERROR(expr)              \
  do {                                     \
    if (OrtStatus* s_ = (expr)) return s_; \
  } while (0)

inline OrtStatus* error(OrtErrorCode code, const std::string& message) {
  return slot<OrtStatus* (*)(OrtErrorCode, const char*)>(g_api, kCreateStatus)(code, message.c_str());
}

// A tensor's shape, held inline: reading an input's shape allocates nothing (a step runs
// hundreds of kernels, each reading several inputs). Ranks up to kMaxRank.
struct Dims {
  static constexpr size_t kMaxRank = 8;
  int64_t values[kMaxRank] = {};
  size_t rank = 0;

  Dims() = default;
  Dims(std::initializer_list<int64_t> list) : rank(std::min(list.size(), kMaxRank)) {   // (the kernels' own, rank <= 4)
    std::copy(list.begin(), list.begin() + rank, values);
  }
  size_t size() const { return rank; }
  const int64_t* begin() const { return values; }
  const int64_t* end() const { return values + rank; }
  const int64_t* data() const { return values; }
  int64_t operator[](size_t i) const { return values[i]; }
  bool operator==(const Dims& other) const { return rank == other.rank && std::equal(begin(), end(), other.begin()); }
  bool operator!=(const Dims& other) const { return !(*this == other); }
};

struct Tensor {
  const OrtValue* value = nullptr;   // nullptr for a fused kernel's intermediate (PartIO)
  Dims dims;
  ONNXTensorElementDataType type = kAnyType;
  void* data = nullptr;
};

// A fused kernel's part (DecoderLayer, decoder_layer.cc) reads its inputs from, and writes its
// outputs to, the fused kernel's tensors instead of ONNX Runtime's context: read_input and
// new_output go through this while a part runs (set by PartScope, on the calling thread).
struct PartIO {
  const Tensor* inputs = nullptr;
  size_t num_inputs = 0;
  std::vector<float>* outputs = nullptr;   // each output's buffer, resized to its shape
  Dims* output_dims = nullptr;
  size_t num_outputs = 0;
};
extern thread_local const PartIO* g_part;

struct PartScope {
  explicit PartScope(const PartIO* io) { g_part = io; }
  ~PartScope() { g_part = nullptr; }
  PartScope(const PartScope&) = delete;
  PartScope& operator=(const PartScope&) = delete;
};

// Whether the loaded ONNX Runtime has kGetTensorElementTypeAndShapeDataReference (API 24; set
// by RegisterCustomOps from its version string).
extern bool g_shape_reference;

// Input `index`'s value alone (no shape query: that allocates, and constant weights whose
// shapes were checked once need only their data).
inline OrtStatus* input_value(OrtKernelContext* ctx, size_t index, const OrtValue** out) {
  return slot<OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**)>(g_api, kKernelContextGetInput)(
      ctx, index, out);
}

inline OrtStatus* rank_error(size_t index, size_t rank) {
  return error(ORT_INVALID_ARGUMENT, "input " + std::to_string(index) + " has rank " + std::to_string(rank) +
                                         ", above the kernels' " + std::to_string(Dims::kMaxRank));
}

template <typename T>
OrtStatus* data_of(const OrtValue* value, T** out);

// Input `index`'s value, data, shape and element type: one call for the shape and type that
// allocates nothing where ONNX Runtime has it (g_shape_reference; ~15 inputs a layer at batch 1:
// SmolLM2 int4 1.015x a step on a 2-core Zen 4 VM), else through a type-and-shape info object;
// a fused kernel's part gets the fused kernel's tensor (PartIO).
inline OrtStatus* read_input(OrtKernelContext* ctx, size_t index, Tensor* out) {
  if (g_part) {
    if (index >= g_part->num_inputs)
      return error(ORT_INVALID_ARGUMENT, "a fused kernel's part read its input " + std::to_string(index) + " of " +
                                             std::to_string(g_part->num_inputs));
    *out = g_part->inputs[index];
    return nullptr;
  }
  RETURN_IF_ERROR(input_value(ctx, index, &out->value));
  RETURN_IF_ERROR(data_of(out->value, &out->data));
#ifndef TRTLLM_LITE_LEGACY_SHAPE_QUERY
  if (g_shape_reference) {
    const int64_t* shape = nullptr;
    size_t rank = 0;
    RETURN_IF_ERROR(slot<OrtStatus* (*)(const OrtValue*, ONNXTensorElementDataType*, const int64_t**, size_t*)>(
        g_api, kGetTensorElementTypeAndShapeDataReference)(out->value, &out->type, &shape, &rank));
    if (rank > Dims::kMaxRank) return rank_error(index, rank);
    out->dims.rank = rank;
    std::copy(shape, shape + rank, out->dims.values);
    return nullptr;
  }
#endif
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF_ERROR(slot<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(
      g_api, kGetTensorTypeAndShape)(out->value, &info));
  size_t rank = 0;
  OrtStatus* s = slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, ONNXTensorElementDataType*)>(
      g_api, kGetTensorElementType)(info, &out->type);
  if (!s) s = slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(g_api, kGetDimensionsCount)(info, &rank);
  if (!s && rank > Dims::kMaxRank) s = rank_error(index, rank);
  if (!s) {
    out->dims.rank = rank;
    s = slot<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(g_api, kGetDimensions)(
        info, out->dims.values, rank);
  }
  slot<void (*)(OrtTensorTypeAndShapeInfo*)>(g_api, kReleaseTensorTypeAndShapeInfo)(info);
  return s;
}

// read_input for inputs 0, 1, 2... into the given tensors, in order; the first error stops it.
template <typename... Tensors>
inline OrtStatus* read_inputs(OrtKernelContext* ctx, Tensors*... tensors) {
  size_t index = 0;
  OrtStatus* status = nullptr;
  ((status = status ? status : read_input(ctx, index++, tensors)), ...);
  return status;
}

template <typename T>
OrtStatus* data_of(const OrtValue* value, T** out) {
  void* p = nullptr;
  RETURN_IF_ERROR(slot<OrtStatus* (*)(OrtValue*, void**)>(g_api, kGetTensorMutableData)(
      const_cast<OrtValue*>(value), &p));
  *out = static_cast<T*>(p);
  return nullptr;
}

// A tensor's data (read_input took it), typed.
template <typename T>
OrtStatus* data_of(const Tensor& tensor, T** out) {
  *out = static_cast<T*>(tensor.data);
  return nullptr;
}

// e^r for |r| <= ln2 / 2 by its degree-6 Taylor polynomial (relative error < 2e-7), in Horner
// form; T is float or a GCC vector of floats.
template <typename T>
inline T exp_reduced(const T& r) {
  T p = T{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

// e^x for x <= 0 (scores minus their max), vectorizable: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by exp_reduced, 2^n through the exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  const float p = exp_reduced(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// float16 bits -> float (no F16C needed: the portable build uses it too).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    f = mant ? NAN : INFINITY;
  } else {
    uint32_t bits = ((exp + 112) << 23) | (mant << 13);
    std::memcpy(&f, &bits, 4);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float -> float16 bits when the value is exact in float16 (true), else false: no rounding
// (a tensor with any inexact value keeps float32 storage); NaN and infinities are not exact.
inline bool float_to_half_exact(float f, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t a = bits & 0x7fffffffu;
  if (a == 0) {
    *out = static_cast<uint16_t>(sign);
    return true;
  }
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp > 15 || exp < -24) return false;
  uint16_t h;
  if (exp >= -14) {
    if (a & 0x1fffu) return false;
    h = static_cast<uint16_t>(sign | ((exp + 15) << 10) | ((a >> 13) & 0x3ff));
  } else {   // subnormal float16: mantissa * 2^-24
    const float m = std::ldexp(std::fabs(f), 24);
    if (m != std::floor(m)) return false;
    h = static_cast<uint16_t>(sign | static_cast<uint32_t>(m));
  }
  *out = h;
  return half_to_float(h) == f;
}

inline std::string dims_string(const Dims& dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

#ifdef __AVX512F__
// e^x for x <= 0, 16 lanes: exp_nonpositive's polynomial, 2^n by vscalefps.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);   // (a NaN x stays NaN: max returns its second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// e^x for x in [-87, 88] (clamped outside), 16 lanes.
inline __m512 exp16(__m512 x) { return exp_nonpositive16(_mm512_min_ps(_mm512_set1_ps(88.0f), x)); }
#endif

#ifdef TRTLLM_LITE_AVX2
// e^x for x <= 0, 8 lanes: exp_nonpositive's polynomial, 2^n through the exponent bits.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);   // (a NaN x stays NaN: max returns its second operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

// A kernel instance (one per node): its attributes, and the step's computation.
struct KernelBase {
  virtual ~KernelBase() = default;
  virtual OrtStatus* compute(OrtKernelContext* context) = 0;
};

// An OrtCustomOp for the CPU execution provider with the status-returning entry points
// (version 16 fields): inputs required up to num_required and optional after it, every output
// required, in default memory, outputs float32.
struct OpSpec {
  const char* name;
  const ONNXTensorElementDataType* input_types;
  size_t num_inputs;
  size_t num_outputs;          // float32 outputs unless output_types says otherwise
  OrtStatus* (*create)(const OrtKernelInfo* info, void** kernel);   // a new KernelBase
  size_t num_required = SIZE_MAX;   // inputs [num_required, num_inputs) may be left out
  const ONNXTensorElementDataType* output_types = nullptr;   // nullptr: every output float32
};

struct CustomOp : OrtCustomOp {
  explicit CustomOp(const OpSpec& spec);
  const OpSpec spec;
};

// A new kernel of type K for OpSpec::create, its attributes read by read(K&) -> OrtStatus*.
template <typename K, typename Read>
OrtStatus* new_kernel(void** kernel, Read read) {
  std::unique_ptr<K> k(new K());
  RETURN_IF_ERROR(read(*k));
  *kernel = k.release();
  return nullptr;
}

inline OrtStatus* float_attribute(const OrtKernelInfo* info, const char* name, float* out) {
  return slot<OrtStatus* (*)(const OrtKernelInfo*, const char*, float*)>(g_api, kKernelInfoGetAttributeFloat)(
      info, name, out);
}

inline OrtStatus* int_attribute(const OrtKernelInfo* info, const char* name, int64_t* out) {
  return slot<OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*)>(g_api, kKernelInfoGetAttributeInt64)(
      info, name, out);
}

// An int attribute the node may leave out: *out keeps its default then (never an error).
inline OrtStatus* optional_int_attribute(const OrtKernelInfo* info, const char* name, int64_t* out) {
  int64_t value = 0;
  OrtStatus* status = int_attribute(info, name, &value);
  if (status) {
    slot<void (*)(OrtStatus*)>(g_api, kReleaseStatus)(status);
    return nullptr;
  }
  *out = value;
  return nullptr;
}

template <typename T = float>
inline OrtStatus* new_output(OrtKernelContext* context, size_t index, std::initializer_list<int64_t> dims,
                             T** data) {
  if (g_part) {   // a fused kernel's part: its float32 outputs in the fused kernel's buffers
    if (sizeof(T) != sizeof(float) || index >= g_part->num_outputs)
      return error(ORT_INVALID_ARGUMENT, "a fused kernel's part wrote its output " + std::to_string(index) + " of " +
                                             std::to_string(g_part->num_outputs) + " (float32 outputs only)");
    size_t size = 1;
    for (int64_t d : dims) size *= static_cast<size_t>(d);
    g_part->outputs[index].resize(size);
    g_part->output_dims[index] = Dims(dims);
    *data = reinterpret_cast<T*>(g_part->outputs[index].data());
    return nullptr;
  }
  OrtValue* value = nullptr;
  RETURN_IF_ERROR(slot<OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**)>(
      g_api, kKernelContextGetOutput)(context, index, dims.begin(), dims.size(), &value));
  return data_of(value, data);
}

// The cores this process may run on (ONNX Runtime's default intra-op thread count).
inline size_t available_cores() {
  static const size_t cores = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    const int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    return static_cast<size_t>(std::max(1, n));
  }();
  return cores;
}

// A fused kernel's parallel region: one ONNX Runtime dispatch runs a driver (the kernel's
// parts one after another) and a helper, and each parallel_for of the parts inside it hands its
// batches to whichever of the two claims them first (a phase: its function, and a ticket word
// phase | batches | next batch, advanced by compare-and-swap; the driver waits until every
// batch is done). ONNX Runtime's own dispatch costs ~1-2 us a call on the 2-core VMs (a thread
// woken, items handed out, the caller waiting at the end), ~5 calls a decoder layer at batch 1.
// No wait depends on the helper being there: the driver claims every batch left, and a helper
// that finds no work for kRegionIdleNs returns, so the region runs (serially) however ONNX
// Runtime places the two. The phase's batch count is in the ticket word itself: a claim checks
// and advances one word, so it can only succeed on a phase still open, whose function and data
// are set (read from a field beside an exhausted ticket, a new phase's larger count let a
// helper claim a batch past the old phase's end while the driver was writing the new phase's
// fields, and run it on a mix of the two: found by QA, session 36). An exception from an item,
// on either thread, ends that batch; the phase's other batches run, and the driver's run()
// rethrows it once all are done.
class WorkRegion {
 public:
  static constexpr int64_t kRegionIdleNs = 200000;
  // driver: fn(user, i) for i in [0, total), in `batches` contiguous ranges (0: one per item)
  void run(void (*fn)(void*, size_t), size_t total, void* user, size_t batches) {
    batches = batches == 0 || batches > total ? total : batches;
    batches = std::min<size_t>(batches, kIndexMask);
    fn_.store(fn, std::memory_order_relaxed);
    user_.store(user, std::memory_order_relaxed);
    total_.store(total, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    phase_ = (phase_ + 1) & kPhaseMask;
    if (phase_ == 0) phase_ = 1;   // (ticket 0: no phase yet)
    ticket_.store(static_cast<uint64_t>(phase_) << (2 * kIndexBits) | static_cast<uint64_t>(batches) << kIndexBits,
                  std::memory_order_release);
    while (claim()) {
    }
    while (done_.load(std::memory_order_acquire) < batches) pause();
    if (failed_.load(std::memory_order_acquire)) {   // an item threw (either thread): the driver's to throw
      failed_.store(false, std::memory_order_relaxed);
      std::rethrow_exception(std::exchange(error_, nullptr));
    }
  }
  // helper: runs what it claims until the driver is done or nothing comes for kRegionIdleNs
  void help() {
    int64_t idle_from = -1;
    for (unsigned spins = 0;; ++spins) {
      if (claim()) {
        idle_from = -1;
        continue;
      }
      if (finished_.load(std::memory_order_acquire)) return;
      if (spins % 64 == 0) {
        const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now().time_since_epoch()).count();
        if (idle_from < 0) idle_from = now;
        if (now - idle_from > kRegionIdleNs) return;
      }
      pause();
    }
  }
  void finish() { finished_.store(true, std::memory_order_release); }

 private:
  static constexpr int kIndexBits = 20;   // batches and next batch: 20 bits each, the phase 24
  static constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
  static constexpr uint32_t kPhaseMask = (uint32_t{1} << 24) - 1;
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  // claims the current phase's next batch and runs it; false when none is left
  bool claim() {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const size_t b = t & kIndexMask, n = (t >> kIndexBits) & kIndexMask;
      if (b >= n) return false;   // (also ticket 0: no phase yet)
      auto* fn = fn_.load(std::memory_order_relaxed);
      void* user = user_.load(std::memory_order_relaxed);
      const size_t total = total_.load(std::memory_order_relaxed);
      // the fields read above are t's phase's if the ticket is still t: they change only after
      // all of its batches are claimed and done, which moves the ticket past t
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        try {
          for (size_t i = total * b / n; i < total * (b + 1) / n; ++i) fn(user, i);
        } catch (...) {   // kept for the driver's run(); the phase's other batches still run
          if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
        }
        done_.fetch_add(1, std::memory_order_release);
        return true;
      }
    }
  }
  std::atomic<uint64_t> ticket_{0};
  std::atomic<void (*)(void*, size_t)> fn_{nullptr};
  std::atomic<void*> user_{nullptr};
  std::atomic<size_t> total_{0}, done_{0};
  std::atomic<bool> finished_{false}, failed_{false};
  std::exception_ptr error_;   // the phase's first exception (written before its batch is done)
  uint32_t phase_ = 0;   // the driver's
};

// The region the calling thread drives (set by the fused kernel around its parts), or null.
extern thread_local WorkRegion* g_region;

// fn(user, i) for i in [0, total) on ONNX Runtime's intra-op threads; in the calling thread
// when there is one item or the caller says the work is too small to hand out (waking the
// pool's threads costs microseconds: most of a batch-1 call's work). num_batches 0 lets ONNX
// Runtime choose (a task per item: for many small, even items, pass available_cores(), one
// contiguous range per core: SmolLM2 int4's 120 linears at batch 1 went 2.3 -> 1.8 ms).
inline OrtStatus* parallel_for(OrtKernelContext* context, void (*fn)(void*, size_t), size_t total, void* user,
                               bool serial = false, size_t num_batches = 0) {
  if (serial || total <= 1) {
    for (size_t i = 0; i < total; ++i) fn(user, i);
    return nullptr;
  }
  if (g_region) {   // inside a fused kernel's region: its two threads, no dispatch
    g_region->run(fn, total, user, num_batches);
    return nullptr;
  }
  return slot<OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*)>(
      g_api, kKernelContextParallelFor)(context, fn, total, num_batches, user);
}

// Below this many multiply-adds a call runs in one thread (measured: a 3072 x 18 offset
// product at batch 1 took ~15 us through the pool, a few us inline).
constexpr int64_t kSerialWork = 1 << 18;

// Each kernel file's op (register.cc adds them to the "trtllm_lite" domain).
const OrtCustomOp* paged_attention_op();
const OrtCustomOp* rotary_split_qkv_op();
const OrtCustomOp* silu_and_mul_op();
const OrtCustomOp* quantize_rows_op();
const OrtCustomOp* dequantize_rows_op();
const OrtCustomOp* block_hadamard_op();
const OrtCustomOp* add_block_offsets_op();
const OrtCustomOp* quantized_linear_op();
const OrtCustomOp* quantized_linear_with_offsets_op();
const OrtCustomOp* quantized_linear_split8_op();
const OrtCustomOp* decoder_layer_op();
const OrtCustomOp* skip_rms_norm_op();
const OrtCustomOp* float_linear_op();
const OrtCustomOp* float_decoder_layer_op();

// The parts of a fused kernel (decoder_layer.cc), made with the attributes their own nodes take.
KernelBase* new_quantized_linear(int64_t n, int64_t k, int64_t block_size, bool with_offsets, bool split8);
KernelBase* new_paged_attention(float scale, bool kv_write_in_op);
KernelBase* new_rotary_split_qkv(int64_t num_heads, int64_t num_kv_heads);
KernelBase* new_silu_and_mul();
KernelBase* new_float_linear(int64_t n, int64_t k);

// Rows of out = rms_norm(a + b) * gamma and sum = a + b (sum may be a or b; out neither), in
// the arithmetic of ONNX Runtime's SkipSimplifiedLayerNormalization, bit for bit: each row's
// squares rounded and summed in order in float32, rms = sqrt(sum / width + eps), out = x / rms
// * gamma. Shapes [rows, width] float32, gamma [width]. (elementwise.cc; SkipRMSNorm's kernel
// and DecoderLayer's two norms.)
struct NormStep {
  const float *a, *b, *gamma;
  float *sum, *out;
  int64_t rows, width;
  float epsilon;
};
OrtStatus* skip_norm(OrtKernelContext* context, NormStep& st);

}  // namespace trtllm_lite_kernels
