"""Fused elementwise ops of the ONNX Runtime graphs, as model-local ONNX functions.

Each replaces a chain of small nodes around a GEMM. ONNX Runtime runs trtllm-lite's C++
kernel for the op where the runtime registers it (``trtllm_lite/ort_kernels/elementwise.cc``,
one pass over the data) and inlines the function body below otherwise (the same ops the
graphs used before). Only the ONNX Runtime graphs use them (``export_onnx``'s ``ort_ops``).

``trtllm_lite::RotarySplitQKV`` (attributes ``num_heads`` H, ``num_kv_heads`` Hkv)::

    qkv [T, (H + 2 Hkv) * D] float32, positions [T] int64,
    cos_cache, sin_cache [max_positions, D / 2] float32
      -> q [T, H, D], k [T, Hkv, D] (rotary embedding applied, rotate-half form: RoFormer,
         Su et al. 2021), v [T, Hkv, D]

``trtllm_lite::SiluAndMul``::

    gate_up [T, 2 I] float32 (gate columns first) -> silu(gate) * up  [T, I]
    (SwiGLU, Shazeer 2020; vLLM's ``silu_and_mul``)

``trtllm_lite::QuantizeRows`` (attribute ``planes``, 1 or 2), a w8a8 linear's input quantized
per token (row)::

    x [T, K] float32 -> q [planes T, K] uint8, scale [planes T, 1] float32
    s = max(max |x[t]| * (1 / 127), 1e-30 / 127), v = x * (1 / s)
    plane 0 (rows 0..T-1):  q = rint(v) + 128,                  scale s
    plane 1 (rows T..2T-1): q = rint((v - rint(v)) * 254) + 128, scale s / 254
    (round half to even, zero point 128; SmoothQuant's per-token dynamic quantization, Xiao
    et al. 2023, vLLM's scaled_int8_quant; the second plane carries the first's rounding error;
    a row holding a NaN or an infinity gets scale NaN, so its output row is NaN)

  Body: ``ReduceMax(Abs(x))``, ``Max(top * (1 / 127), tiny)``, ``QuantizeLinear`` of ``v``
  and of ``(v - Round(v)) * 254``, both planes concatenated, the first ``planes`` kept.

``trtllm_lite::DequantizeRows`` (attribute ``planes``), the integer GEMM's output back::

    y [planes T, N], scale [planes T, 1], bias [N] float32
      -> sum over planes p of y[p T + t] * scale[p T + t], + bias   [T, N] float32

  Body: ``Mul``, ``Reshape`` to ``[planes, T, N]``, ``ReduceSum`` over planes, ``Add``.

``trtllm_lite::BlockHadamard``, a w8a8 down projection's input rotated before it is quantized
(``--rotate-activations``, :mod:`builder.rotation`)::

    x [T, K] float32, hadamard [b, b] float32 (H_b, the normalized Sylvester Hadamard matrix;
    b a power of two dividing K)
      -> each row's blocks of b values times H_b   [T, K] float32
    (the kernel: the fast Walsh-Hadamard transform, b log2 b additions a block; QuaRot,
    Ashkboos et al. 2024)

  Body: ``Reshape`` to ``[T, K / b, b]``, ``MatMul`` by ``hadamard``, ``Reshape`` back.

``trtllm_lite::AddBlockOffsets`` (attribute ``block_size``), a block-quantized weight's float
offsets (GGUF Q4_1's block mins, :mod:`builder.quantize`) added to MatMulNBits' output::

    y [T, N], x [T, K], offsets [N, K / block_size], block_sum_matrix [K, K / block_size] (0/1)
      -> y + blocksum(x) @ offsets^T   [T, N] float32   (the matrix is the body's; the kernel
         sums the blocks itself)

``trtllm_lite::QuantizedLinear`` and ``QuantizedLinearWithOffsets`` (attributes ``N``, ``K``,
``block_size``), a 4-bit block-quantized linear at float32 activations in one node
(``trtllm_lite/ort_kernels/quantized_linear.cc``; :mod:`builder.quantize` for the tensors)::

    x [T, K] float32, qweight [N, K / bs, bs / 2] uint8, scales [N, K / bs] float32,
    zero_points [N, ceil(K / bs / 2)] uint8 (4-bit, low nibble first)
    [, offsets [N, nbo] float32, block_sum_matrix [K, nbo] (0/1, the first nbo blocks of x)]
      -> x @ dequant(W)^T [+ blocksum(x) @ offsets^T]   [T, N] float32

  Body: ``com.microsoft.MatMulNBits`` (accuracy level 0) [then ``AddBlockOffsets``].

``trtllm_lite::QuantizedLinearSplit8`` takes an 8-bit weight split into two 4-bit halves
(:func:`builder.quantize.split_8bit`: the same tensors as ``QuantizedLinearWithOffsets``, ``K``
the halves' width, twice x's) and x ``[T, K / 2]`` once::

  Body: ``Concat(x, x)`` then ``QuantizedLinearWithOffsets``. Its kernel recombines the 8-bit
  codes once and reads x as it is: no ``[x, x]`` copy (at a 1,024-token prompt chunk of an
  int8 SmolLM2, ~800 MB of writes a step), fewer bytes and half the multiply-adds.

``trtllm_lite::DecoderLayer`` (no function body: only in the kernels' graphs,
:func:`fuse_decoder_layers`) is a Llama layer over 4-bit (or split 8-bit) linears, its ten
nodes in one; ``trtllm_lite::FloatDecoderLayer`` the same over ``FloatLinear``s.

``trtllm_lite::FloatLinear`` (attributes ``N``, ``K``; no function body: only in a float32
engine's ``*.kernels.float_linear.onnx`` graphs, :func:`use_float_linears`)::

    x [T, K] float32, panels [ceil(N / 32), K, 32] float32 (:func:`float_linear_panels`)
      -> x @ W^T   [T, N] float32
"""
from __future__ import annotations

import numpy as np

from .onnx_graph import MS_DOMAIN
from .paged_attention import DOMAIN

ROTARY_OP_TYPE = "RotarySplitQKV"
SILU_OP_TYPE = "SiluAndMul"
SKIP_NORM_OP_TYPE = "SkipRMSNorm"
QUANTIZE_ROWS_OP_TYPE = "QuantizeRows"
DEQUANTIZE_ROWS_OP_TYPE = "DequantizeRows"
BLOCK_HADAMARD_OP_TYPE = "BlockHadamard"
OFFSETS_OP_TYPE = "AddBlockOffsets"
QUANTIZED_LINEAR_OP_TYPE = "QuantizedLinear"
QUANTIZED_LINEAR_OFFSETS_OP_TYPE = "QuantizedLinearWithOffsets"
QUANTIZED_LINEAR_SPLIT8_OP_TYPE = "QuantizedLinearSplit8"
QUANTIZED_LINEAR_OP_TYPES = (QUANTIZED_LINEAR_OP_TYPE, QUANTIZED_LINEAR_OFFSETS_OP_TYPE, QUANTIZED_LINEAR_SPLIT8_OP_TYPE)
QUANTIZED_LINEAR_ATTRIBUTES = ("N", "K", "block_size")
FLOAT_LINEAR_OP_TYPE = "FloatLinear"
FLOAT_LINEAR_PANEL = 32      # weight rows per panel (trtllm_lite/ort_kernels/float_linear.cc)
PANELS_SUFFIX = ".panels"


def make_rotary_function(num_heads: int, num_kv_heads: int, head_dim: int, opset: int | None = None):
    """``RotarySplitQKV``'s body for this model's head counts: ONNX Runtime's
    ``com.microsoft.RotaryEmbedding`` over the q and k heads together, then the splits."""
    from onnx import helper

    from .onnx_graph import OPSET, NodeWriter

    w = NodeWriter("rq_")
    hq, hkv, d = num_heads, num_kv_heads, head_dim
    qkv = w.op("Reshape", "qkv", w.const([-1, 1, (hq + 2 * hkv) * d]))
    qk, v = w.op("Split", qkv, w.const([(hq + hkv) * d, hkv * d]), axis=2, outputs=2)
    qk = w.op("RotaryEmbedding", qk, w.op("Unsqueeze", "positions", w.const([1])), "cos_cache", "sin_cache",
              domain=MS_DOMAIN, num_heads=hq + hkv, interleaved=0)
    w.op("Split", w.op("Reshape", qk, w.const([-1, hq + hkv, d])), w.const([hq, hkv]), axis=1,
         outputs=["q", "k"])
    w.op("Reshape", v, w.const([-1, hkv, d]), outputs=["v"])
    return helper.make_function(DOMAIN, ROTARY_OP_TYPE, ["qkv", "positions", "cos_cache", "sin_cache"],
                                ["q", "k", "v"], w.nodes,
                                [helper.make_opsetid("", opset or OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                                attributes=["num_heads", "num_kv_heads"])


def make_silu_function(opset: int | None = None):
    """``SiluAndMul``'s body: split, ``gate * sigmoid(gate) * up`` (ONNX Runtime fuses the
    first product into its ``QuickGelu``)."""
    from onnx import helper

    from .onnx_graph import OPSET, NodeWriter

    w = NodeWriter("sm_")
    gate, up = w.op("Split", "gate_up", axis=1, num_outputs=2, outputs=2)
    w.op("Mul", w.op("Mul", gate, w.op("Sigmoid", gate)), up, outputs=["output"])
    return helper.make_function(DOMAIN, SILU_OP_TYPE, ["gate_up"], ["output"], w.nodes,
                                [helper.make_opsetid("", opset or OPSET)])


def make_skip_norm_function(epsilon: float, opset: int | None = None):
    """``SkipRMSNorm``'s body: ONNX Runtime's ``SkipSimplifiedLayerNormalization``, its
    outputs 0 (``rmsnorm(x + skip) * gamma``) and 3 (``x + skip``). The model's one epsilon
    is written into the body (the nodes' ``epsilon`` attribute says the same; the C++ kernel
    reads the attribute), as the rotary body takes the model's head counts."""
    from onnx import helper

    from .onnx_graph import OPSET, NodeWriter

    w = NodeWriter("sn_")
    w.op("SkipSimplifiedLayerNormalization", "x", "skip", "gamma", domain=MS_DOMAIN, epsilon=float(epsilon),
         outputs=["y", "", "", "sum"])
    return helper.make_function(DOMAIN, SKIP_NORM_OP_TYPE, ["x", "skip", "gamma"], ["y", "sum"], w.nodes,
                                [helper.make_opsetid("", opset or OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                                attributes=["epsilon"])


def _planes(w) -> str:
    """``[planes]`` int64: the function's ``planes`` attribute as a tensor."""
    from onnx import AttributeProto, helper

    planes = w.fresh("planes")
    node = helper.make_node("Constant", [], [planes], name=w.fresh("Constant"))
    node.attribute.append(AttributeProto(name="value_int", ref_attr_name="planes", type=AttributeProto.INT))
    w.nodes.append(node)
    return w.op("Reshape", planes, w.const([1]))


def make_quantize_rows_function(opset: int | None = None):
    """``QuantizeRows``' body in standard ops (module docstring): both planes, then the first
    ``planes`` of them (the ``planes`` attribute, read by the body's Constant)."""
    import numpy as np
    from onnx import helper

    from .onnx_graph import OPSET, NodeWriter

    w = NodeWriter("qr_")
    top = w.op("ReduceMax", w.op("Abs", "x"), w.const([-1]), keepdims=1)                 # [T, 1]
    s = w.op("Max", w.op("Mul", top, w.const(1 / 127, np.float32)), w.const(1e-30 / 127, np.float32))
    # + sum(x * 0): 0 for a finite row, NaN for one holding a NaN or an infinity (scale NaN, as the kernel)
    s = w.op("Add", s, w.op("ReduceSum", w.op("Mul", "x", w.const(0.0, np.float32)), w.const([-1]), keepdims=1))
    v = w.op("Mul", "x", w.op("Reciprocal", s))
    one, zero_point = w.const(1.0, np.float32), w.const(128, np.uint8)
    q1 = w.op("QuantizeLinear", v, one, zero_point)
    q2 = w.op("QuantizeLinear", w.op("Mul", w.op("Sub", v, w.op("Round", v)), w.const(254.0, np.float32)),
              one, zero_point)
    rows = w.op("Mul", _planes(w), w.op("Shape", "x", start=0, end=1))
    start, axis = w.const([0]), w.const([0])
    w.op("Slice", w.op("Concat", q1, q2, axis=0), start, rows, axis, outputs=["q"])
    w.op("Slice", w.op("Concat", s, w.op("Div", s, w.const(254.0, np.float32)), axis=0), start, rows, axis,
         outputs=["scale"])
    return helper.make_function(DOMAIN, QUANTIZE_ROWS_OP_TYPE, ["x"], ["q", "scale"], w.nodes,
                                [helper.make_opsetid("", opset or OPSET)], attributes=["planes"])


def make_dequantize_rows_function(opset: int | None = None):
    """``DequantizeRows``' body in standard ops (module docstring)."""
    from onnx import helper

    from .onnx_graph import OPSET, NodeWriter

    w = NodeWriter("dr_")
    scaled = w.op("Mul", "y", "scale")                                                   # [P T, N]
    shape = w.op("Concat", _planes(w), w.const([-1]), w.op("Shape", "y", start=1, end=2), axis=0)  # [P, -1, N]
    total = w.op("ReduceSum", w.op("Reshape", scaled, shape), w.const([0]), keepdims=0)
    w.op("Add", total, "bias", outputs=["output"])
    return helper.make_function(DOMAIN, DEQUANTIZE_ROWS_OP_TYPE, ["y", "scale", "bias"], ["output"], w.nodes,
                                [helper.make_opsetid("", opset or OPSET)], attributes=["planes"])


def make_block_hadamard_function(opset: int | None = None):
    """``BlockHadamard``'s body (module docstring)."""
    from onnx import helper

    from .onnx_graph import OPSET, NodeWriter

    w = NodeWriter("bh_")
    b = w.op("Shape", "hadamard", start=0, end=1)
    blocks = w.op("Concat", w.op("Shape", "x", start=0, end=1), w.op("Div", w.op("Shape", "x", start=1, end=2), b), b,
                  axis=0)   # [T, K / b, b] (no -1: T may be 0)
    rotated = w.op("MatMul", w.op("Reshape", "x", blocks), "hadamard")
    w.op("Reshape", rotated, w.op("Shape", "x"), outputs=["output"])
    return helper.make_function(DOMAIN, BLOCK_HADAMARD_OP_TYPE, ["x", "hadamard"], ["output"], w.nodes,
                                [helper.make_opsetid("", opset or OPSET)])


def make_offsets_function(opset: int | None = None):
    """``AddBlockOffsets``' body: the block sums as one MatMul with the 0/1 matrix, then
    ``Gemm(sums, offsets, y, transB=1)``."""
    from onnx import helper

    from .onnx_graph import OPSET, NodeWriter

    w = NodeWriter("bo_")
    sums = w.op("MatMul", "x", "block_sum_matrix")                    # [T, blocks]
    w.op("Gemm", sums, "offsets", "y", transB=1, outputs=["output"])
    return helper.make_function(DOMAIN, OFFSETS_OP_TYPE, ["y", "x", "offsets", "block_sum_matrix"], ["output"],
                                w.nodes, [helper.make_opsetid("", opset or OPSET)], attributes=["block_size"])


def make_quantized_linear_functions(opset: int | None = None) -> list:
    """``QuantizedLinear``'s and ``QuantizedLinearWithOffsets``' bodies: MatMulNBits at
    accuracy level 0 over the node's attributes (attribute references), then, with offsets,
    ``AddBlockOffsets`` (a function itself: its kernel or its body); ``QuantizedLinearSplit8``'s:
    ``[x, x]`` into ``QuantizedLinearWithOffsets``."""
    from onnx import AttributeProto, helper

    from .onnx_graph import OPSET

    def matmul_nbits(output: str):
        node = helper.make_node("MatMulNBits", ["x", "qweight", "scales", "zero_points"], [output],
                                name="ql_matmul_nbits", domain=MS_DOMAIN, bits=4, accuracy_level=0)
        node.attribute.extend(helper.make_attribute_ref(a, AttributeProto.INT) for a in QUANTIZED_LINEAR_ATTRIBUTES)
        return node

    opsets = [helper.make_opsetid("", opset or OPSET), helper.make_opsetid(MS_DOMAIN, 1),
              helper.make_opsetid(DOMAIN, 1)]
    plain = helper.make_function(DOMAIN, QUANTIZED_LINEAR_OP_TYPE, ["x", "qweight", "scales", "zero_points"],
                                 ["output"], [matmul_nbits("output")], opsets,
                                 attributes=list(QUANTIZED_LINEAR_ATTRIBUTES))
    offsets = helper.make_node(OFFSETS_OP_TYPE, ["y", "x", "offsets", "block_sum_matrix"], ["output"],
                               name="ql_add_block_offsets", domain=DOMAIN)
    offsets.attribute.append(helper.make_attribute_ref("block_size", AttributeProto.INT))
    with_offsets = helper.make_function(
        DOMAIN, QUANTIZED_LINEAR_OFFSETS_OP_TYPE,
        ["x", "qweight", "scales", "zero_points", "offsets", "block_sum_matrix"], ["output"],
        [matmul_nbits("y"), offsets], opsets, attributes=list(QUANTIZED_LINEAR_ATTRIBUTES))
    inputs = ["xx", "qweight", "scales", "zero_points", "offsets", "block_sum_matrix"]
    call = helper.make_node(QUANTIZED_LINEAR_OFFSETS_OP_TYPE, inputs, ["output"], name="ql_split8_call", domain=DOMAIN)
    call.attribute.extend(helper.make_attribute_ref(a, AttributeProto.INT) for a in QUANTIZED_LINEAR_ATTRIBUTES)
    split8 = helper.make_function(
        DOMAIN, QUANTIZED_LINEAR_SPLIT8_OP_TYPE, ["x", *inputs[1:]], ["output"],
        [helper.make_node("Concat", ["x", "x"], ["xx"], name="ql_split8_concat", axis=1), call], opsets,
        attributes=list(QUANTIZED_LINEAR_ATTRIBUTES))
    return [plain, with_offsets, split8]


DECODER_LAYER_OP_TYPE = "DecoderLayer"
FLOAT_DECODER_LAYER_OP_TYPE = "FloatDecoderLayer"
_LAYER_LINEARS = ("qkv", "o", "gate_up", "down")


def _attributes(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _match_decoder_layer(qkv, consumers: dict, graph_outputs: set):
    """The ten nodes of one decoder layer from its QKV projection ``qkv`` (a 4-bit linear) to
    the next norm, or None where the graph is not that chain (a bias, another op, an
    intermediate read twice or a graph output, the four linears not one kind)."""
    def only_consumer(node, output=0, op_type=None, domain=DOMAIN):
        name = node.output[output]
        users = consumers.get(name, [])
        if name in graph_outputs or len(users) != 1:
            return None
        user = users[0]
        return user if user.op_type == op_type and user.domain == domain else None

    from .paged_attention import OP_TYPE as ATTENTION_OP_TYPE

    linear_kind = qkv.op_type
    rotary = only_consumer(qkv, 0, ROTARY_OP_TYPE)
    if rotary is None or rotary.input[0] != qkv.output[0]:
        return None
    attention = only_consumer(rotary, 0, ATTENTION_OP_TYPE)
    if (attention is None or list(attention.input[:3]) != list(rotary.output)
            or any(len(consumers.get(name, [])) != 1 or name in graph_outputs for name in rotary.output[1:])
            or len(attention.input) != 9 or _attributes(attention).get("kv_write_in_op") != 1):
        return None
    reshape = only_consumer(attention, 0, "Reshape", "")
    o = reshape and only_consumer(reshape, 0, linear_kind)
    mlp_norm = o and only_consumer(o, 0, SKIP_NORM_OP_TYPE)
    if mlp_norm is None or mlp_norm.input[1] != o.output[0] or len(mlp_norm.input) != 3:
        return None
    gate_up = only_consumer(mlp_norm, 0, linear_kind)
    silu = gate_up and only_consumer(gate_up, 0, SILU_OP_TYPE)
    down = silu and only_consumer(silu, 0, linear_kind)
    next_norm = down and only_consumer(down, 0, SKIP_NORM_OP_TYPE)
    if (next_norm is None or len(mlp_norm.output) != 2 or not mlp_norm.output[1] or len(next_norm.output) != 2
            or not next_norm.output[1] or next_norm.input[0] != mlp_norm.output[1]
            or next_norm.input[1] != down.output[0]
            or len(next_norm.input) != 3):
        return None
    residual = mlp_norm.output[1]
    if residual in graph_outputs or len(consumers.get(residual, [])) != 1:
        return None
    return [qkv, rotary, attention, reshape, o, mlp_norm, gate_up, silu, down, next_norm]


def fuse_decoder_layers(model):
    """A copy of an ONNX Runtime kernels graph (``*.kernels.onnx``) whose Llama-family decoder
    layers over 4-bit (or split 8-bit) linears are each one ``trtllm_lite::DecoderLayer`` node
    (``trtllm_lite/ort_kernels/decoder_layer.cc``): the ten nodes from a layer's QKV projection
    (``QuantizedLinear``, ``QuantizedLinearWithOffsets`` or ``QuantizedLinearSplit8``, all four
    linears the same) through ``RotarySplitQKV``,
    ``PagedAttention`` (storing its K/V: :func:`builder.paged_attention.with_kv_write_in_op`),
    the o projection, the post-attention ``SkipRMSNorm``, gate/up,
    ``SiluAndMul`` and down to the next layer's (or the final) norm::

        DecoderLayer(normed_in, residual_in, qkv weight, positions, cos, sin, key_cache,
                     value_cache, slot_mapping, block_tables, context_lens, query_start_loc,
                     o weight, mlp_norm, gate_up weight, down weight, next_norm
                     [, the four linears' offsets]) -> normed_out, residual_out

    (each weight: ``qweight, scales, zero_points``). The op has no ONNX function body: only
    sessions with trtllm-lite's kernels registered take these graphs. Layers that are not that
    chain (biases, mixed linears, w8a8 engines, GPT-2) are left as they are. Layers over
    ``FloatLinear`` nodes (:func:`use_float_linears`) become ``trtllm_lite::FloatDecoderLayer``
    nodes, the same inputs with one panels tensor a linear and no offsets.

    Measured on SmolLM2 int4 at batch 1 (2-core Zen 4 VM, docs/benchmarks.md session 33): ~340
    -> ~40 nodes a step; ONNX Runtime's work outside trtllm-lite's kernels 0.54 -> 0.19 ms a
    step (the kernels +0.09 ms: the norms moved in), 1.07x a step over six alternating loads.

    Args:
        model: ``onnx.ModelProto``; left unchanged.
    Returns:
        the new ``onnx.ModelProto`` (the same graph where no layer matches).
    """
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    consumers: dict = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}
    fused: dict[int, object] = {}      # id of a layer's last node -> its DecoderLayer node
    removed: set[int] = set()
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type not in (*QUANTIZED_LINEAR_OP_TYPES, FLOAT_LINEAR_OP_TYPE):
            continue
        chain = _match_decoder_layer(node, consumers, graph_outputs)
        if chain is None or any(id(n) in removed for n in chain):
            continue
        qkv, rotary, attention, _, o, mlp_norm, gate_up, _, down, next_norm = chain
        linears = dict(zip(_LAYER_LINEARS, (qkv, o, gate_up, down)))
        floats = qkv.op_type == FLOAT_LINEAR_OP_TYPE
        split8 = qkv.op_type == QUANTIZED_LINEAR_SPLIT8_OP_TYPE
        offsets = split8 or qkv.op_type == QUANTIZED_LINEAR_OFFSETS_OP_TYPE
        weights = slice(1, 2) if floats else slice(1, 4)   # FloatLinear's panels; qweight, scales, zero_points
        inputs = [qkv.input[0], mlp_norm.input[0], *qkv.input[weights], *rotary.input[1:4], *attention.input[3:9],
                  *o.input[weights], mlp_norm.input[2], *gate_up.input[weights], *down.input[weights],
                  next_norm.input[2]]
        if offsets:
            inputs += [linears[name].input[4] for name in _LAYER_LINEARS]
        attributes = {}
        for name, linear in linears.items():
            a = _attributes(linear)
            attributes.update({f"{name}_N": a["N"], f"{name}_K": a["K"]})
            if not floats:
                attributes[f"{name}_block_size"] = a["block_size"]
        rotary_attributes, attention_attributes = _attributes(rotary), _attributes(attention)
        attributes.update(num_heads=rotary_attributes["num_heads"], num_kv_heads=rotary_attributes["num_kv_heads"],
                          scale=attention_attributes["scale"], kv_write_in_op=1,
                          mlp_epsilon=_attributes(mlp_norm)["epsilon"], next_epsilon=_attributes(next_norm)["epsilon"])
        if not floats:
            attributes["split8"] = int(split8)
        fused[id(next_norm)] = helper.make_node(
            FLOAT_DECODER_LAYER_OP_TYPE if floats else DECODER_LAYER_OP_TYPE, inputs,
            [next_norm.output[0], next_norm.output[1]],
            name=f"decoder_layer_{len(fused)}", domain=DOMAIN, **attributes)
        removed.update(id(n) for n in chain)
    if not fused:
        return out
    # each layer's node where its last node was: every input is computed by then
    nodes = [fused.get(id(n), n) for n in graph.node if id(n) not in removed or id(n) in fused]
    del graph.node[:]
    graph.node.extend(nodes)
    from .paged_attention import _keep_nodes_feeding_outputs

    _keep_nodes_feeding_outputs(graph)   # (the Reshapes' shape constants)
    return out


def float_linear_panels(weight: np.ndarray) -> np.ndarray:
    """A linear's weight ``[N, K]`` as ``FloatLinear``'s panels ``[ceil(N / 32), K, 32]``
    float32: ``panels[p, k, j] = weight[32 p + j, k]``, 0 for rows past ``N``."""
    n, k = weight.shape
    num_panels = -(-n // FLOAT_LINEAR_PANEL)
    padded = np.zeros((num_panels * FLOAT_LINEAR_PANEL, k), np.float32)
    padded[:n] = weight
    return np.ascontiguousarray(padded.reshape(num_panels, FLOAT_LINEAR_PANEL, k).transpose(0, 2, 1))


def use_float_linears(model, store):
    """A copy of a float32 engine's kernels graph whose ``Gemm(x, W, transB=1)`` nodes (no bias,
    ``alpha`` = ``beta`` = 1, ``W`` a float32 weight of ``store``) are ``trtllm_lite::FloatLinear
    (x, W.panels)`` nodes (``trtllm_lite/ort_kernels/float_linear.cc``: a batch-1 decode step
    streams the panels at ~36 GB/s where MLAS read SmolLM2's weights at ~29 on a 2-core Xeon VM).

    Each weight's panels (:func:`float_linear_panels`) are added to ``store`` once, under
    ``W + ".panels"`` (the prefill and decode graphs share them); a weight no other node of the
    graph reads leaves the graph (the tied embedding stays: its ``Gather`` reads it). The op
    has no ONNX function body: only sessions with trtllm-lite's kernels take these graphs.

    Args:
        model: ``onnx.ModelProto`` whose initializers are ``store``'s; left unchanged.
        store: the engine's :class:`builder.onnx_graph.WeightStore` (written after this).
    Returns:
        ``(new model, number of Gemm nodes replaced, number of Gemm / MatMul nodes left over a
        float32 weight of ``store``)`` (a bias, another layout: Qwen2's QKV, GPT-2's linears).
    """
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    initializers = {i.name for i in graph.initializer}

    def replaceable(node) -> bool:
        a = _attributes(node)
        weight = node.input[1] if node.op_type == "Gemm" and node.domain == "" and len(node.input) == 2 else None
        return (weight is not None and weight in initializers and weight in store.arrays
                and store.arrays[weight].dtype == np.float32 and store.arrays[weight].ndim == 2
                and a.get("transB") == 1 and a.get("transA", 0) == 0 and a.get("alpha", 1.0) == 1.0)

    def float_linear(node) -> bool:   # any GEMM over a float32 weight of the store
        return (node.op_type in ("Gemm", "MatMul") and node.domain == "" and len(node.input) > 1
                and node.input[1] in store.arrays and store.arrays[node.input[1]].dtype == np.float32)

    left = sum(float_linear(node) and not replaceable(node) for node in graph.node)
    if left:   # (their panels are not stored either)
        return out, 0, left
    replaced, nodes = 0, []
    for node in graph.node:
        if not replaceable(node):
            nodes.append(node)
            continue
        weight = node.input[1]
        n, k = store.arrays[weight].shape
        panels = weight + PANELS_SUFFIX
        if panels not in store.arrays:
            store.add(panels, float_linear_panels(store.arrays[weight]))
        nodes.append(helper.make_node(FLOAT_LINEAR_OP_TYPE, [node.input[0], panels], list(node.output),
                                      name=node.name, domain=DOMAIN, N=n, K=k))
        replaced += 1
    if not replaced:
        return out, 0, left
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    kept = [i for i in graph.initializer if i.name in used]
    new = sorted(name for name in used if name.endswith(PANELS_SUFFIX) and name not in initializers)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.initializer.extend(store.initializer_protos(new))
    return out, replaced, left
