// trtllm_lite::PagedAttention as a TensorRT IPluginV3 (TensorRT >= 10.3): the C++ twin of
// paged_attention_plugin.py (same name "PagedAttention", version "1", namespace "trtllm_lite",
// fields num_heads / num_kv_heads (int32) and scale (float32), same I/O), so an engine built with
// either runs with either.
//
// I/O (the kv_write="in_op" graphs of builder/export_onnx.py; schema in builder/paged_attention.py):
//   inputs   0 query [T, H, D]  1 key [T, Hkv, D]  2 value [T, Hkv, D]            fp16 | bf16
//            3 key_cache, 4 value_cache [num_blocks, block_size, Hkv, D]          same type
//            5 slot_mapping [T]  6 block_tables [S, max_blocks]  7 context_lens [S]
//            8 query_start_loc [S + 1]                                            int64
//   outputs  0 output [T, H, D]; 1 key_cache_out aliases input 3; 2 value_cache_out aliases input 4
// enqueue() calls tl_paged_attention (plugins_cu/include/trtllm_lite_kernels.h): the step's K/V
// are written into the pools through the aliased outputs, then decode (T == S) or prefill
// attention runs. Needs PreviewFeature::kALIASED_PLUGIN_IO_10_03 at build time.
#pragma once

#include <NvInferRuntime.h>

#include <string>
#include <vector>

namespace trtllm_lite {

class PagedAttentionPlugin : public nvinfer1::IPluginV3,
                             public nvinfer1::IPluginV3OneCore,
                             public nvinfer1::IPluginV3OneBuildV2,
                             public nvinfer1::IPluginV3OneRuntime {
 public:
  PagedAttentionPlugin(int32_t numHeads, int32_t numKvHeads, float scale);

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;

  // IPluginV3OneBuildV2
  int32_t getNbOutputs() const noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                          nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs,
                          nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                                 int32_t nbInputs, int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
  int32_t getAliasedInput(int32_t outputIndex) noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

 private:
  int32_t mNumHeads;
  int32_t mNumKvHeads;
  float mScale;
  std::vector<nvinfer1::PluginField> mFields;
  nvinfer1::PluginFieldCollection mFieldCollection{};
};

class PagedAttentionPluginCreator : public nvinfer1::IPluginCreatorV3One {
 public:
  PagedAttentionPluginCreator();
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;

 private:
  std::vector<nvinfer1::PluginField> mFields;
  nvinfer1::PluginFieldCollection mFieldCollection{};
};

}  // namespace trtllm_lite
