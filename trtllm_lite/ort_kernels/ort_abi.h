// The parts of ONNX Runtime's C ABI that trtllm-lite's CPU kernels use.
//
// ONNX Runtime's Python wheel ships no C headers, so this file declares, from the documented
// stable ABI, only what the kernels call. The ABI only grows: `OrtApi` is a table of function
// pointers whose existing slots never move (ONNX Runtime checks the positions with static
// asserts in its own build), and `OrtCustomOp` gains fields only at its end, read according to
// its `version` field. Slot numbers below are positions in the `OrtApi` table.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtStatus;
struct OrtApi;                 // opaque here: reached through ort_api_slot()
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtCustomOpDomain;
struct OrtSessionOptions;

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version) noexcept;
  const char* (*GetVersionString)() noexcept;
};

enum OrtErrorCode { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };

enum ONNXTensorElementDataType {
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,   // as a custom op's input type: any tensor type
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 = 7,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL = 9,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
};

enum OrtCustomOpInputOutputCharacteristic { INPUT_OUTPUT_REQUIRED = 0, INPUT_OUTPUT_OPTIONAL = 1 };
enum OrtMemType { OrtMemTypeDefault = 0 };

// A custom operator's description (ONNX Runtime reads the fields its `version` covers).
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  ONNXTensorElementDataType (*GetInputType)(const OrtCustomOp*, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  ONNXTensorElementDataType (*GetOutputType)(const OrtCustomOp*, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void* kernel, OrtKernelContext*);
  void (*KernelDestroy)(void* kernel);
  // version 8
  OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const OrtCustomOp*, size_t index);
  OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp*, size_t index);
  // version 13
  OrtMemType (*GetInputMemoryType)(const OrtCustomOp*, size_t index);
  // version 14
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  // version 16: the status-returning kernel entry points
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext*);
  // version 17 and later
  void* InferOutputShapeFn;
  int (*GetStartVersion)(const OrtCustomOp*);
  int (*GetEndVersion)(const OrtCustomOp*);
  void* GetMayInplace;
  void* ReleaseMayInplace;
  void* GetAliasMap;
  void* ReleaseAliasMap;
};

}  // extern "C"

namespace ort_abi {

// OrtApi slots used here, with their C signatures.
enum Slot : size_t {
  kCreateStatus = 0,                  // OrtStatus* (OrtErrorCode, const char* msg)
  kCreateCustomOpDomain = 26,         // OrtStatus* (const char* domain, OrtCustomOpDomain** out)
  kCustomOpDomainAdd = 27,            // OrtStatus* (OrtCustomOpDomain*, const OrtCustomOp*)
  kAddCustomOpDomain = 28,            // OrtStatus* (OrtSessionOptions*, OrtCustomOpDomain*)
  kGetTensorMutableData = 51,         // OrtStatus* (OrtValue*, void** out)
  kGetTensorElementType = 60,         // OrtStatus* (const OrtTensorTypeAndShapeInfo*, ONNXTensorElementDataType* out)
  kGetDimensionsCount = 61,           // OrtStatus* (const OrtTensorTypeAndShapeInfo*, size_t* out)
  kGetDimensions = 62,                // OrtStatus* (const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)
  kGetTensorTypeAndShape = 65,        // OrtStatus* (const OrtValue*, OrtTensorTypeAndShapeInfo** out)
  kKernelInfoGetAttributeFloat = 85,  // OrtStatus* (const OrtKernelInfo*, const char* name, float* out)
  kKernelInfoGetAttributeInt64 = 86,  // OrtStatus* (const OrtKernelInfo*, const char* name, int64_t* out)
  kKernelContextGetInput = 90,        // OrtStatus* (const OrtKernelContext*, size_t, const OrtValue** out)
  kKernelContextGetOutput = 91,       // OrtStatus* (OrtKernelContext*, size_t, const int64_t* dims,
                                      //             size_t dim_count, OrtValue** out)
  kReleaseStatus = 93,                // void (OrtStatus*)
  kReleaseTensorTypeAndShapeInfo = 99,  // void (OrtTensorTypeAndShapeInfo*)
  kKernelContextParallelFor = 274,    // OrtStatus* (const OrtKernelContext*, void (*fn)(void*, size_t),
                                      //             size_t total, size_t num_batch, void* usr_data)
  // API 24 (ONNX Runtime 1.24): a tensor's element type and a pointer to its shape, allocating
  // nothing (GetTensorTypeAndShape allocates an info object to read them from)
  kGetTensorElementTypeAndShapeDataReference = 414,   // OrtStatus* (const OrtValue*, ONNXTensorElementDataType* out,
                                                       //             const int64_t** shape, size_t* rank)
};

// The API version of kGetTensorElementTypeAndShapeDataReference (read_input uses it where the
// loaded ONNX Runtime has it, and the calls of API 17 otherwise).
constexpr uint32_t kShapeReferenceApiVersion = 24;

// The API version requested: the newest slot the kernels need (KernelContext_ParallelFor) is in 1.17.
constexpr uint32_t kApiVersion = 17;

template <typename Fn>
inline Fn slot(const OrtApi* api, Slot index) {
  return reinterpret_cast<Fn>(reinterpret_cast<void* const*>(api)[index]);
}

}  // namespace ort_abi
