// trtllm_lite::DecoderLayer: a Llama-family decoder layer of a 4-bit (or split 8-bit) engine in
// one node, from its attention's input norm's output to the next layer's (or the final) norm
// (builder/fused_ops.py fuse_decoder_layers writes it into the *.kernels.onnx graphs);
// trtllm_lite::FloatDecoderLayer is the same layer over FloatLinear's (float_linear.cc) in a
// float32 engine's *.kernels.float_linear.onnx graphs, its inputs kFloatSlots below:
//
//   qkv   = QuantizedLinear(normed_in)                     [T, (H + 2 Hkv) D]
//   q, k, v = RotarySplitQKV(qkv, positions, cos, sin)
//   attn  = PagedAttention(q, k, v, key_cache, value_cache, slot_mapping, block_tables,
//                          context_lens, query_start_loc)  (kv_write_in_op: stores the K/V)
//   mid   = residual_in + QuantizedLinear_o(attn)          (the attention's residual)
//   up    = QuantizedLinear_gate_up(rms_norm(mid) * mlp_norm)
//   down  = QuantizedLinear_down(silu(gate) * up)
//   residual_out = mid + down, normed_out = rms_norm(residual_out) * next_norm
//
//   inputs   0 normed_in [T, hidden] float32, 1 residual_in [T, hidden] float32,
//            2-4 qkv qweight, scales, zero_points (QuantizedLinear's), 5 positions [T] int64,
//            6-7 cos_cache, sin_cache [max_positions, D / 2] float32, 8-9 key_cache, value_cache
//            [num_blocks, block_size, Hkv, D] float32 or float16, 10 slot_mapping [T],
//            11 block_tables [S, max_blocks], 12 context_lens [S], 13 query_start_loc [S + 1]
//            int64, 14-16 o's weight, 17 mlp_norm [hidden] float32, 18-20 gate_up's weight,
//            21-23 down's weight, 24 next_norm [hidden] float32, 25-28 (optional, all or none)
//            the four linears' offsets (QuantizedLinearWithOffsets')
//   attrs    {qkv,o,gate_up,down}_{N,K,block_size}, num_heads, num_kv_heads, scale,
//            kv_write_in_op, mlp_epsilon, next_epsilon, split8 (1: the linears are
//            QuantizedLinearSplit8's, K the halves' width, twice x's; offsets then given)
//   outputs  normed_out [T, hidden] float32, residual_out [T, hidden] float32
//
// Each part is the op's own kernel (quantized_linear.cc, elementwise.cc, paged_attention.cc),
// run on this node's tensors through PartIO (kernel_common.h), so the layer computes what its
// ten nodes compute; the two RMS norms with the residual adds are SkipRMSNorm's (elementwise.cc
// skip_norm, in the arithmetic of ONNX Runtime's SkipSimplifiedLayerNormalization): the layer's
// outputs are the ten nodes' bit for bit (tested). What the fusion removes is ONNX Runtime's
// per-node work between them: a node's dispatch, its inputs' and outputs' handling and arena
// allocations (ten nodes a layer -> one). At decode steps (up to kRegionTokens tokens) the parts'
// parallel loops run in one WorkRegion (kernel_common.h): one ONNX Runtime dispatch a layer
// instead of one per parallel part (SmolLM2 int4 batch 1: five a layer; its decode step 1.01-
// 1.04x, step-interleaved on the 2-core Zen 4 VM, as the hour's speed goes; 12 sequences 1.00x). The parts' items and their arithmetic are
// the same, so the outputs are too.
#include <array>
#include <exception>
#include <mutex>

#include "kernel_common.h"

namespace trtllm_lite_kernels {
namespace {

constexpr size_t kNumInputs = 29, kNumRequired = 25;
constexpr ONNXTensorElementDataType kU8 = static_cast<ONNXTensorElementDataType>(2);   // uint8
constexpr ONNXTensorElementDataType kInputTypes[kNumInputs] = {
    kF32, kF32,                          // normed_in, residual_in
    kU8, kF32, kU8,                      // qkv
    kI64, kF32, kF32,                    // positions, cos, sin
    kAnyType, kAnyType,                  // key_cache, value_cache (float32 or float16: PagedAttention checks)
    kI64, kI64, kI64, kI64,              // slot_mapping, block_tables, context_lens, query_start_loc
    kU8, kF32, kU8, kF32,                // o, mlp_norm
    kU8, kF32, kU8,                      // gate_up
    kU8, kF32, kU8, kF32,                // down, next_norm
    kF32, kF32, kF32, kF32};             // offsets of qkv, o, gate_up, down
constexpr size_t kNormedIn = 0, kResidualIn = 1, kQkv = 2, kPositions = 5, kCos = 6, kSin = 7, kKeyCache = 8,
                 kSlotMapping = 10, kO = 14, kMlpNorm = 17, kGateUp = 18, kDown = 21, kNextNorm = 24,
                 kOffsets = 25;
struct Linear {
  int64_t n = 0, k = 0, block_size = 0;
};

// FloatDecoderLayer: the same layer over float32 linears (FloatLinear's panels, one tensor a
// linear), its 17 inputs in DecoderLayer's order less the quantized weights' second and third
// tensors and the offsets; each goes to the DecoderLayer input slot below.
constexpr size_t kNumFloatInputs = 17;
constexpr ONNXTensorElementDataType kFloatInputTypes[kNumFloatInputs] = {
    kF32, kF32, kF32,                    // normed_in, residual_in, qkv panels
    kI64, kF32, kF32,                    // positions, cos, sin
    kAnyType, kAnyType,                  // key_cache, value_cache
    kI64, kI64, kI64, kI64,              // slot_mapping, block_tables, context_lens, query_start_loc
    kF32, kF32, kF32, kF32, kF32};       // o panels, mlp_norm, gate_up panels, down panels, next_norm
constexpr size_t kFloatSlots[kNumFloatInputs] = {kNormedIn, kResidualIn, kQkv, kPositions, kCos, kSin, kKeyCache,
                                                 kKeyCache + 1, kSlotMapping, kSlotMapping + 1, kSlotMapping + 2,
                                                 kSlotMapping + 3, kO, kMlpNorm, kGateUp, kDown, kNextNorm};

// Steps of up to this many tokens (decode steps) run the layer's parts in one WorkRegion, where
// ONNX Runtime's dispatch is a share of each part's time worth saving.
constexpr int64_t kRegionTokens = 16;

struct Kernel : KernelBase {
  Linear qkv, o, gate_up, down;
  int64_t num_heads = 0, num_kv_heads = 0, kv_write_in_op = 1, split8 = 0;
  bool float_linears = false;   // FloatDecoderLayer: the linears are FloatLinear's
  float scale = 1.0f, mlp_epsilon = 1e-6f, next_epsilon = 1e-6f;
  // the parts, made on the first call (when the node's offsets are known to be there or not)
  std::unique_ptr<KernelBase> qkv_part, rotary_part, attention_part, o_part, gate_up_part, silu_part, down_part;
  bool with_offsets = false;
  std::mutex mutex;
  OrtStatus* compute(OrtKernelContext* context) override;
  OrtStatus* make_parts(bool offsets);
  // the parts, on inputs `in` (read by compute), into the outputs [T, hidden] float32
  OrtStatus* run_layer(OrtKernelContext* context, const Tensor* in, float* normed_out, float* residual_out);
};

OrtStatus* Kernel::make_parts(bool offsets) {
  with_offsets = offsets;
  const bool split = split8 == 1;
  auto linear = [&](const Linear& l) {
    return float_linears ? new_float_linear(l.n, l.k) : new_quantized_linear(l.n, l.k, l.block_size, offsets, split);
  };
  qkv_part.reset(linear(qkv));
  o_part.reset(linear(o));
  gate_up_part.reset(linear(gate_up));
  down_part.reset(linear(down));
  rotary_part.reset(new_rotary_split_qkv(num_heads, num_kv_heads));
  attention_part.reset(new_paged_attention(scale, kv_write_in_op == 1));
  silu_part.reset(new_silu_and_mul());
  return nullptr;
}

// A part's call on `inputs`, its outputs into `outputs` (their shapes into `dims`).
OrtStatus* run_part(OrtKernelContext* context, KernelBase& part, std::initializer_list<Tensor> inputs,
                    std::vector<float>* outputs, Dims* dims, size_t num_outputs) {
  const PartIO io{inputs.begin(), inputs.size(), outputs, dims, num_outputs};
  PartScope scope(&io);
  return part.compute(context);
}

Tensor intermediate(std::vector<float>& buffer, const Dims& dims) {
  Tensor t;
  t.dims = dims;
  t.type = kF32;
  t.data = buffer.data();
  return t;
}

OrtStatus* Kernel::compute(OrtKernelContext* context) {
  Tensor in[kNumInputs];
  size_t offsets = 0;
  if (float_linears) {
    for (size_t i = 0; i < kNumFloatInputs; ++i) RETURN_IF_ERROR(read_input(context, i, &in[kFloatSlots[i]]));
  } else {
    for (size_t i = 0; i < kNumRequired; ++i) RETURN_IF_ERROR(read_input(context, i, &in[i]));
  }
  // the offsets: all four or none (input i is absent when its value is null)
  for (size_t i = kOffsets; i < (float_linears ? kOffsets : kNumInputs); ++i) {
    RETURN_IF_ERROR(input_value(context, i, &in[i].value));
    if (in[i].value) {
      RETURN_IF_ERROR(read_input(context, i, &in[i]));
      ++offsets;
    }
  }
  if ((offsets != 0 && offsets != 4) || (split8 == 1 && offsets != 4))
    return error(ORT_INVALID_ARGUMENT, "DecoderLayer: the linears' offsets must be given for all four or none "
                                       "(all four for split 8-bit linears), got " + std::to_string(offsets));
  {
    std::lock_guard<std::mutex> lock(mutex);   // (sessions may run on several threads at once)
    if (!qkv_part || with_offsets != (offsets == 4)) RETURN_IF_ERROR(make_parts(offsets == 4));
  }
  const Tensor& x = in[kNormedIn];
  const Tensor& residual = in[kResidualIn];
  const int64_t x_width = split8 == 1 ? qkv.k / 2 : qkv.k;   // a split 8-bit weight's K is twice x's
  if (x.dims.size() != 2 || residual.dims != x.dims || x.dims[1] != x_width || o.n != x.dims[1] ||
      down.n != x.dims[1] || in[kMlpNorm].dims != Dims{x.dims[1]} || in[kNextNorm].dims != Dims{x.dims[1]})
    return error(ORT_INVALID_ARGUMENT, "DecoderLayer: normed_in " + dims_string(x.dims) + ", residual_in " +
                                           dims_string(residual.dims) + ", mlp_norm " + dims_string(in[kMlpNorm].dims) +
                                           ", next_norm " + dims_string(in[kNextNorm].dims) + " are not [T, " +
                                           std::to_string(x_width) + "] twice and [" + std::to_string(x_width) + "]");
  const int64_t T = x.dims[0], hidden = x.dims[1];
  float *normed_out, *residual_out;
  RETURN_IF_ERROR(new_output(context, 0, {T, hidden}, &normed_out));
  RETURN_IF_ERROR(new_output(context, 1, {T, hidden}, &residual_out));
  if (T > kRegionTokens || available_cores() < 2) return run_layer(context, in, normed_out, residual_out);
  // item 0 drives the parts, item 1 helps (WorkRegion)
  struct Call {
    Kernel* kernel;
    OrtKernelContext* context;
    const Tensor* in;
    float *normed_out, *residual_out;
    WorkRegion region;
    OrtStatus* status = nullptr;
  } call{this, context, in, normed_out, residual_out, {}};
  auto item = [](void* user, size_t i) {
    Call& c = *static_cast<Call*>(user);
    if (i == 1) return c.region.help();
    g_region = &c.region;
    try {   // (an exception would otherwise leave through ONNX Runtime's thread pool, not its Run)
      c.status = c.kernel->run_layer(c.context, c.in, c.normed_out, c.residual_out);
    } catch (const std::exception& e) {
      c.status = error(ORT_FAIL, std::string("DecoderLayer: ") + e.what());
    } catch (...) {
      c.status = error(ORT_FAIL, "DecoderLayer: an unknown exception");
    }
    g_region = nullptr;
    c.region.finish();
  };
  RETURN_IF_ERROR(parallel_for(context, item, 2, &call, false, 2));
  return call.status;
}

OrtStatus* Kernel::run_layer(OrtKernelContext* context, const Tensor* in, float* normed_out, float* residual_out) {
  const Tensor& x = in[kNormedIn];
  const Tensor& residual = in[kResidualIn];
  const int64_t T = x.dims[0], hidden = x.dims[1];
  // the intermediates: per calling thread, reused layer after layer
  thread_local std::vector<float> buffers[8];
  thread_local Dims dims[8];
  std::vector<float>&qkv_out = buffers[0], *qkv_split = &buffers[1], &attn = buffers[4], &mid = buffers[5],
                     &up = buffers[6], &act = buffers[7];
  Dims* split_dims = &dims[1];
  auto weights = [&](size_t first, size_t linear) {   // a linear's weight tensors, its offsets last
    return std::array<Tensor, 4>{in[first], in[first + 1], in[first + 2], in[kOffsets + linear]};
  };
  auto linear = [&](KernelBase& part, const Tensor& input, size_t first, size_t index, std::vector<float>& out,
                    Dims& out_dims) {
    const auto w = weights(first, index);
    if (float_linears) return run_part(context, part, {input, w[0]}, &out, &out_dims, 1);
    return with_offsets ? run_part(context, part, {input, w[0], w[1], w[2], w[3]}, &out, &out_dims, 1)
                        : run_part(context, part, {input, w[0], w[1], w[2]}, &out, &out_dims, 1);
  };
  RETURN_IF_ERROR(linear(*qkv_part, x, kQkv, 0, qkv_out, dims[0]));
  RETURN_IF_ERROR(run_part(context, *rotary_part,
                           {intermediate(qkv_out, dims[0]), in[kPositions], in[kCos], in[kSin]}, qkv_split,
                           split_dims, 3));
  Tensor attention_in[9] = {intermediate(buffers[1], dims[1]), intermediate(buffers[2], dims[2]),
                            intermediate(buffers[3], dims[3])};
  for (size_t i = 0; i < 6; ++i) attention_in[3 + i] = in[kKeyCache + i];
  RETURN_IF_ERROR(run_part(context, *attention_part,
                           {attention_in[0], attention_in[1], attention_in[2], attention_in[3], attention_in[4],
                            attention_in[5], attention_in[6], attention_in[7], attention_in[8]},
                           &attn, &dims[4], 1));
  const Dims attn_rows{T, dims[4].rank == 3 ? dims[4][1] * dims[4][2] : -1};   // [T, H, D] -> [T, H D]
  RETURN_IF_ERROR(linear(*o_part, intermediate(attn, attn_rows), kO, 1, mid, dims[5]));
  // mid = residual_in + o's output (in place), up's input = its norm (into act's buffer)
  act.resize(static_cast<size_t>(T * hidden));
  const float* residual_data = static_cast<const float*>(residual.data);
  const float* mlp_norm = static_cast<const float*>(in[kMlpNorm].data);
  NormStep mlp{residual_data, mid.data(), mlp_norm, mid.data(), act.data(), T, hidden, mlp_epsilon};
  RETURN_IF_ERROR(skip_norm(context, mlp));
  RETURN_IF_ERROR(linear(*gate_up_part, intermediate(act, Dims{T, hidden}), kGateUp, 2, up, dims[6]));
  RETURN_IF_ERROR(run_part(context, *silu_part, {intermediate(up, dims[6])}, &act, &dims[7], 1));
  RETURN_IF_ERROR(linear(*down_part, intermediate(act, dims[7]), kDown, 3, qkv_out, dims[0]));   // (qkv_out reused)
  NormStep next{mid.data(), qkv_out.data(), static_cast<const float*>(in[kNextNorm].data), residual_out, normed_out,
                T, hidden, next_epsilon};
  return skip_norm(context, next);
}

OrtStatus* read_linear(const OrtKernelInfo* info, const std::string& name, Linear* out, bool float_linear) {
  RETURN_IF_ERROR(int_attribute(info, (name + "_N").c_str(), &out->n));
  RETURN_IF_ERROR(int_attribute(info, (name + "_K").c_str(), &out->k));
  return float_linear ? nullptr : int_attribute(info, (name + "_block_size").c_str(), &out->block_size);
}

template <bool FLOAT_LINEARS>
OrtStatus* create_kernel(const OrtKernelInfo* info, void** kernel) {
  return new_kernel<Kernel>(kernel, [info](Kernel& k) {
    k.float_linears = FLOAT_LINEARS;
    RETURN_IF_ERROR(read_linear(info, "qkv", &k.qkv, FLOAT_LINEARS));
    RETURN_IF_ERROR(read_linear(info, "o", &k.o, FLOAT_LINEARS));
    RETURN_IF_ERROR(read_linear(info, "gate_up", &k.gate_up, FLOAT_LINEARS));
    RETURN_IF_ERROR(read_linear(info, "down", &k.down, FLOAT_LINEARS));
    RETURN_IF_ERROR(int_attribute(info, "num_heads", &k.num_heads));
    RETURN_IF_ERROR(int_attribute(info, "num_kv_heads", &k.num_kv_heads));
    RETURN_IF_ERROR(optional_int_attribute(info, "kv_write_in_op", &k.kv_write_in_op));
    RETURN_IF_ERROR(optional_int_attribute(info, "split8", &k.split8));
    RETURN_IF_ERROR(float_attribute(info, "scale", &k.scale));
    RETURN_IF_ERROR(float_attribute(info, "mlp_epsilon", &k.mlp_epsilon));
    return float_attribute(info, "next_epsilon", &k.next_epsilon);
  });
}

constexpr ONNXTensorElementDataType kOutputTypes[2] = {kF32, kF32};

}  // namespace

const OrtCustomOp* decoder_layer_op() {
  static const CustomOp op({"DecoderLayer", kInputTypes, kNumInputs, 2, create_kernel<false>, kNumRequired, kOutputTypes});
  return &op;
}

const OrtCustomOp* float_decoder_layer_op() {
  static const CustomOp op({"FloatDecoderLayer", kFloatInputTypes, kNumFloatInputs, 2, create_kernel<true>,
                            kNumFloatInputs, kOutputTypes});
  return &op;
}

}  // namespace trtllm_lite_kernels
