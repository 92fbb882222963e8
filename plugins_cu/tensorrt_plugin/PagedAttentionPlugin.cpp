// trtllm_lite::PagedAttention IPluginV3: see PagedAttentionPlugin.h for the I/O contract.
#include "PagedAttentionPlugin.h"

#include <cstring>

#include "trtllm_lite_kernels.h"

namespace trtllm_lite {
namespace {

constexpr char const* kName = "PagedAttention";
constexpr char const* kVersion = "1";
constexpr char const* kNamespace = "trtllm_lite";
constexpr int32_t kNumInputs = 9;
constexpr int32_t kNumOutputs = 3;
constexpr int32_t kKeyCache = 3, kValueCache = 4, kBlockTables = 6, kContextLens = 7;

bool isFloat16(nvinfer1::DataType t) {
  return t == nvinfer1::DataType::kHALF || t == nvinfer1::DataType::kBF16;
}

// Kernel sizes from the tensor shapes alone (no device reads): decode when every sequence has
// one token (T == S, since each sequence has at least one), else prefill with T as the bound on
// the query length; max_seq_len bounded by the block-table width. Bounds only size grids.
struct Sizes {
  int32_t numTokens, numSeqs, headDim, blockSize, maxBlocks, maxQueryLen, maxSeqLen;
};

Sizes sizesOf(nvinfer1::Dims const& query, nvinfer1::Dims const& keyCache, nvinfer1::Dims const& blockTables) {
  Sizes s{};
  s.numTokens = static_cast<int32_t>(query.d[0]);
  s.headDim = static_cast<int32_t>(query.d[2]);
  s.blockSize = static_cast<int32_t>(keyCache.d[1]);
  s.numSeqs = static_cast<int32_t>(blockTables.d[0]);
  s.maxBlocks = static_cast<int32_t>(blockTables.d[1]);
  s.maxQueryLen = s.numTokens == s.numSeqs ? 1 : s.numTokens;
  s.maxSeqLen = s.maxBlocks * s.blockSize;
  return s;
}

double fieldValue(nvinfer1::PluginField const& f) {
  switch (f.type) {
    case nvinfer1::PluginFieldType::kINT32: return *static_cast<int32_t const*>(f.data);
    case nvinfer1::PluginFieldType::kINT64: return static_cast<double>(*static_cast<int64_t const*>(f.data));
    case nvinfer1::PluginFieldType::kFLOAT32: return *static_cast<float const*>(f.data);
    case nvinfer1::PluginFieldType::kFLOAT64: return *static_cast<double const*>(f.data);
    default: return 0.0;
  }
}

}  // namespace

PagedAttentionPlugin::PagedAttentionPlugin(int32_t numHeads, int32_t numKvHeads, float scale)
    : mNumHeads(numHeads), mNumKvHeads(numKvHeads), mScale(scale) {}

nvinfer1::IPluginCapability* PagedAttentionPlugin::getCapabilityInterface(
    nvinfer1::PluginCapabilityType type) noexcept {
  switch (type) {
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuildV2*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
  }
  return nullptr;
}

nvinfer1::IPluginV3* PagedAttentionPlugin::clone() noexcept {
  try {
    return new PagedAttentionPlugin(mNumHeads, mNumKvHeads, mScale);
  } catch (...) {
    return nullptr;
  }
}

char const* PagedAttentionPlugin::getPluginName() const noexcept { return kName; }
char const* PagedAttentionPlugin::getPluginVersion() const noexcept { return kVersion; }
char const* PagedAttentionPlugin::getPluginNamespace() const noexcept { return kNamespace; }
int32_t PagedAttentionPlugin::getNbOutputs() const noexcept { return kNumOutputs; }

int32_t PagedAttentionPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                                                 nvinfer1::DataType const* inputTypes,
                                                 int32_t nbInputs) const noexcept {
  if (nbInputs != kNumInputs || nbOutputs != kNumOutputs) return -1;
  outputTypes[0] = inputTypes[0];
  outputTypes[1] = inputTypes[kKeyCache];
  outputTypes[2] = inputTypes[kValueCache];
  return 0;
}

int32_t PagedAttentionPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                                              nvinfer1::DimsExprs const*, int32_t,
                                              nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                                              nvinfer1::IExprBuilder&) noexcept {
  if (nbInputs != kNumInputs || nbOutputs != kNumOutputs) return -1;
  outputs[0] = inputs[0];
  outputs[1] = inputs[kKeyCache];
  outputs[2] = inputs[kValueCache];
  return 0;
}

bool PagedAttentionPlugin::supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                                                     int32_t nbInputs, int32_t nbOutputs) noexcept {
  if (nbInputs != kNumInputs || nbOutputs != kNumOutputs || pos < 0 || pos >= kNumInputs + kNumOutputs) {
    return false;
  }
  nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
  if (desc.format != nvinfer1::TensorFormat::kLINEAR) return false;
  bool const isFloatSlot = pos <= kValueCache || pos >= kNumInputs;
  if (isFloatSlot) return isFloat16(desc.type) && desc.type == inOut[0].desc.type;
  return desc.type == nvinfer1::DataType::kINT64;
}

int32_t PagedAttentionPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const*, int32_t,
                                              nvinfer1::DynamicPluginTensorDesc const*, int32_t) noexcept {
  return 0;
}

size_t PagedAttentionPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t,
                                              nvinfer1::DynamicPluginTensorDesc const*, int32_t) const noexcept {
  Sizes const s = sizesOf(inputs[0].max, inputs[kKeyCache].max, inputs[kBlockTables].max);
  return tl_decode_workspace_size(s.numSeqs, mNumHeads, mNumKvHeads, s.headDim, s.maxSeqLen);
}

int32_t PagedAttentionPlugin::getAliasedInput(int32_t outputIndex) noexcept {
  return outputIndex == 1 ? kKeyCache : outputIndex == 2 ? kValueCache : -1;
}

int32_t PagedAttentionPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                                            nvinfer1::PluginTensorDesc const*, int32_t nbOutputs) noexcept {
  if (nbInputs != kNumInputs || nbOutputs != kNumOutputs) return -1;
  bool const heads = in[0].dims.d[1] == mNumHeads && in[kKeyCache].dims.d[2] == mNumKvHeads;
  return heads && in[kContextLens].dims.d[0] == in[kBlockTables].dims.d[0] ? 0 : -1;
}

int32_t PagedAttentionPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
                                      nvinfer1::PluginTensorDesc const*, void const* const* inputs,
                                      void* const* outputs, void* workspace, cudaStream_t stream) noexcept {
  Sizes const s = sizesOf(inputDesc[0].dims, inputDesc[kKeyCache].dims, inputDesc[kBlockTables].dims);
  int const dtype = inputDesc[0].type == nvinfer1::DataType::kBF16 ? TL_DTYPE_BF16 : TL_DTYPE_FP16;
  size_t const workspaceSize = tl_decode_workspace_size(s.numSeqs, mNumHeads, mNumKvHeads, s.headDim, s.maxSeqLen);
  // The pools are read and written through the aliased outputs (TensorRT binds them to the
  // pool inputs' memory).
  return tl_paged_attention(
      dtype, inputs[0], inputs[1], inputs[2], outputs[1], outputs[2], outputs[0],
      static_cast<int64_t const*>(inputs[5]), static_cast<int64_t const*>(inputs[kBlockTables]),
      static_cast<int64_t const*>(inputs[kContextLens]), static_cast<int64_t const*>(inputs[8]),
      s.numSeqs, s.numTokens, s.maxQueryLen, s.maxSeqLen, mNumHeads, mNumKvHeads, s.headDim, s.blockSize,
      s.maxBlocks, mScale, workspace, workspaceSize, reinterpret_cast<tl_stream_t>(stream)) == 0 ? 0 : -1;
}

nvinfer1::IPluginV3* PagedAttentionPlugin::attachToContext(nvinfer1::IPluginResourceContext*) noexcept {
  return clone();
}

nvinfer1::PluginFieldCollection const* PagedAttentionPlugin::getFieldsToSerialize() noexcept {
  mFields = {
      nvinfer1::PluginField("num_heads", &mNumHeads, nvinfer1::PluginFieldType::kINT32, 1),
      nvinfer1::PluginField("num_kv_heads", &mNumKvHeads, nvinfer1::PluginFieldType::kINT32, 1),
      nvinfer1::PluginField("scale", &mScale, nvinfer1::PluginFieldType::kFLOAT32, 1),
  };
  mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
  mFieldCollection.fields = mFields.data();
  return &mFieldCollection;
}

PagedAttentionPluginCreator::PagedAttentionPluginCreator() {
  mFields = {
      nvinfer1::PluginField("num_heads", nullptr, nvinfer1::PluginFieldType::kINT32, 1),
      nvinfer1::PluginField("num_kv_heads", nullptr, nvinfer1::PluginFieldType::kINT32, 1),
      nvinfer1::PluginField("scale", nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1),
  };
  mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
  mFieldCollection.fields = mFields.data();
}

char const* PagedAttentionPluginCreator::getPluginName() const noexcept { return kName; }
char const* PagedAttentionPluginCreator::getPluginVersion() const noexcept { return kVersion; }
char const* PagedAttentionPluginCreator::getPluginNamespace() const noexcept { return kNamespace; }
nvinfer1::PluginFieldCollection const* PagedAttentionPluginCreator::getFieldNames() noexcept {
  return &mFieldCollection;
}

nvinfer1::IPluginV3* PagedAttentionPluginCreator::createPlugin(char const*, nvinfer1::PluginFieldCollection const* fc,
                                                               nvinfer1::TensorRTPhase) noexcept {
  try {
    int32_t numHeads = 0, numKvHeads = 0;
    float scale = 0.0F;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      nvinfer1::PluginField const& f = fc->fields[i];
      if (f.data == nullptr || f.length < 1) continue;
      if (std::strcmp(f.name, "num_heads") == 0) numHeads = static_cast<int32_t>(fieldValue(f));
      if (std::strcmp(f.name, "num_kv_heads") == 0) numKvHeads = static_cast<int32_t>(fieldValue(f));
      if (std::strcmp(f.name, "scale") == 0) scale = static_cast<float>(fieldValue(f));
    }
    if (numHeads <= 0 || numKvHeads <= 0 || numHeads % numKvHeads != 0 || scale <= 0.0F) return nullptr;
    return new PagedAttentionPlugin(numHeads, numKvHeads, scale);
  } catch (...) {
    return nullptr;
  }
}

}  // namespace trtllm_lite

// Entry point IPluginRegistry::loadLibrary() looks up (TensorRT >= 10): the library's creators.
extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static trtllm_lite::PagedAttentionPluginCreator creator;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}
