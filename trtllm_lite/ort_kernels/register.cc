// The library's entry point for ONNX Runtime (SessionOptions.register_custom_ops_library):
// every kernel's op in the "trtllm_lite" domain, on the CPU execution provider.
#include <cstdio>

#include "kernel_common.h"

namespace trtllm_lite_kernels {

const OrtApi* g_api = nullptr;
bool g_shape_reference = false;
thread_local const PartIO* g_part = nullptr;
thread_local WorkRegion* g_region = nullptr;

namespace {
// Whether ONNX Runtime "major.minor.patch" has API version `api` (its API version is its minor
// version in 1.x).
bool has_api(const char* version, uint32_t api) {
  unsigned major = 0, minor = 0;
  return version && std::sscanf(version, "%u.%u", &major, &minor) == 2 && (major > 1 || minor >= api);
}

const OpSpec& spec_of(const OrtCustomOp* op) { return static_cast<const CustomOp*>(op)->spec; }
}  // namespace

CustomOp::CustomOp(const OpSpec& s) : OrtCustomOp{}, spec(s) {
  version = 16;   // ONNX Runtime reads the fields through KernelComputeV2
  GetName = [](const OrtCustomOp* op) { return spec_of(op).name; };
  GetExecutionProviderType = [](const OrtCustomOp*) { return "CPUExecutionProvider"; };
  GetInputTypeCount = [](const OrtCustomOp* op) { return spec_of(op).num_inputs; };
  GetInputType = [](const OrtCustomOp* op, size_t i) { return spec_of(op).input_types[i]; };
  GetOutputTypeCount = [](const OrtCustomOp* op) { return spec_of(op).num_outputs; };
  GetOutputType = [](const OrtCustomOp* op, size_t i) {
    return spec_of(op).output_types ? spec_of(op).output_types[i] : kF32;
  };
  KernelDestroy = [](void* kernel) { delete static_cast<KernelBase*>(kernel); };
  GetInputCharacteristic = [](const OrtCustomOp* op, size_t i) {
    return i < spec_of(op).num_required ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  };
  GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  CreateKernelV2 = [](const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** kernel) {
    return spec_of(op).create(info, kernel);
  };
  KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
    return static_cast<KernelBase*>(kernel)->compute(context);
  };
}

}  // namespace trtllm_lite_kernels

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* base) {
  using namespace trtllm_lite_kernels;
  g_api = base->GetApi(kApiVersion);
  if (g_api == nullptr) return nullptr;   // an older ONNX Runtime: the function bodies run
  g_shape_reference = has_api(base->GetVersionString(), kShapeReferenceApiVersion);
  OrtCustomOpDomain* domain = nullptr;
  RETURN_IF_ERROR(slot<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(g_api, kCreateCustomOpDomain)(
      "trtllm_lite", &domain));
  for (const OrtCustomOp* op : {paged_attention_op(), rotary_split_qkv_op(), silu_and_mul_op(),
                                add_block_offsets_op(), quantized_linear_op(), quantized_linear_with_offsets_op(),
                                quantized_linear_split8_op(), decoder_layer_op(), quantize_rows_op(),
                                dequantize_rows_op(), block_hadamard_op(), skip_rms_norm_op(), float_linear_op(),
                                float_decoder_layer_op()})
    RETURN_IF_ERROR(slot<OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*)>(g_api, kCustomOpDomainAdd)(
        domain, op));
  // the domain must outlive every session that uses it: it is never released
  return slot<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(g_api, kAddCustomOpDomain)(options, domain);
}
