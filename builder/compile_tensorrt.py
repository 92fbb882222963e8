"""``--backend tensorrt`` / ``--backend tensorrt-rtx``: compile the exported graph into one engine.

One engine per model (``model.plan``), built from the **prefill** graph with two optimization
profiles, so the weights sit on the GPU once and each kind of step runs kernels tuned for it::

    profile 0 "prefill"  tokens per step T in [1, max_num_batched_tokens], sequences S in
                         [1, max_num_seqs], logits rows N in [1, max_num_batched_tokens]
    profile 1 "decode"   T = S = N in [1, max_num_seqs] (one token per sequence)
    both                 block_tables [S, W], W in [1, ceil(max_seq_len / block_size)];
                         pools [num_blocks, block_size, Hkv, D], num_blocks in [1, max_num_blocks]

(A decode step is a prefill-graph call whose ``logits_indices`` is ``arange(S)``; the decode
graph stays in the engine directory for ONNX Runtime.) ``max_num_blocks`` is the most blocks the
runtime's KV pool may hold: ``max_num_seqs * ceil(max_seq_len / block_size)``, the cap
:class:`~trtllm_lite.core.llm_engine.LLMEngine` applies.

Precision (``--dtype``): networks are strongly typed (TensorRT 11 has no other kind; TensorRT-RTX
neither), so a 16-bit engine is built from :func:`mixed_precision`'s copy of the graph
(``prefill.<dtype>.onnx``): GEMMs, the PagedAttention op and the KV pools in float16 / bfloat16,
the residual stream, norms, rotary and logits in float32.

TensorRT (``tensorrt`` >= 10.3, needs a GPU to build; float16 or bfloat16, the kernels' types):
the ``kv_write="in_op"`` graph, whose PagedAttention nodes become the ``trtllm_lite::PagedAttention``
plugin (``plugins_cu/tensorrt_plugin``: the C++ library when built, else the Python plugin); the
plugin writes K/V into the pools in place through outputs aliased to the pool inputs
(``PreviewFeature.ALIASED_PLUGIN_IO_10_03``).

TensorRT-RTX (``tensorrt-rtx``, builds on a machine without a GPU; runs on Ampere and newer RTX
parts, not on data-centre Hopper; float32, float16 or bfloat16): TensorRT-RTX has no plugin
layers (its network has no ``add_plugin_v3``), so it takes the ``kv_write="runtime"`` graph and
inlines the op's ONNX function body. Activation memory is sized at run time for the step's
shapes (``PreviewFeature.RUNTIME_ACTIVATION_RESIZE_10_10``): the function body's scores are
``[S, Hkv, G * Q, L]``, far larger at the profile's maximum than at a typical step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from trtllm_lite.engine_dir import tensorrt_kv_cache_dtype_ok
from trtllm_lite.runners.tensorrt_runner import (  # noqa: F401  (TensorRTUnavailable: re-exported)
    TensorRTUnavailable, import_tensorrt, register_plugin)

from .paged_attention import INPUT_NAMES, METADATA_NAMES

_ATTN_BIAS = len(INPUT_NAMES) + METADATA_NAMES.index("attn_bias")   # PagedAttention input index

PLAN_FILE = "model.plan"
PROFILES = ("prefill", "decode")
PRECISIONS = {"tensorrt": ("float16", "bfloat16"), "tensorrt-rtx": ("float32", "float16", "bfloat16")}
KV_WRITE = {"tensorrt": "in_op", "tensorrt-rtx": "runtime"}


@dataclass(frozen=True)
class ProfileLimits:
    """The build limits the optimization profiles span (tokens, sequences, blocks)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_seq_len: int
    block_size: int

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @property
    def max_num_blocks(self) -> int:
        """Most KV blocks a pool may hold (``LLMEngine``'s cap on ``num_kv_blocks``)."""
        return self.max_num_seqs * self.max_blocks_per_seq


def profile_shapes(profile: str, limits: ProfileLimits, kv_dims: tuple[int, int],
                   num_layers: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """``input name -> (min, opt, max)`` shapes of one optimization profile of the prefill graph.

    Args:
        profile: ``"prefill"`` or ``"decode"`` (module docstring).
        kv_dims: ``(num_kv_heads, head_dim)``.
    """
    lim = limits
    if profile == "prefill":
        tokens = (1, min(256, lim.max_num_batched_tokens), lim.max_num_batched_tokens)
        seqs = (1, min(4, lim.max_num_seqs), lim.max_num_seqs)
        logits = (1, seqs[1], lim.max_num_batched_tokens)
    elif profile == "decode":
        tokens = seqs = logits = (1, min(16, lim.max_num_seqs), lim.max_num_seqs)
    else:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    width = (1, min(lim.max_blocks_per_seq, -(-512 // lim.block_size)), lim.max_blocks_per_seq)
    pool = lim.max_num_blocks
    shapes = {name: tuple((t,) for t in tokens) for name in ("input_ids", "positions", "slot_mapping")}
    shapes["block_tables"] = tuple(zip(seqs, width))
    shapes["context_lens"] = tuple((s,) for s in seqs)
    shapes["query_start_loc"] = tuple((s + 1,) for s in seqs)
    shapes["logits_indices"] = tuple((n,) for n in logits)
    for i in range(num_layers):
        for name in (f"key_cache.{i}", f"value_cache.{i}"):
            shapes[name] = tuple((n, lim.block_size, *kv_dims) for n in (1, pool, pool))
    return shapes


def mixed_precision(model, dtype: str):
    """A copy of an exported graph typed for a strongly typed TensorRT network (TensorRT 11
    has no other kind): every GEMM and the PagedAttention op run in ``dtype``, the residual
    stream, norms, rotary and logits stay float32; ``new_keys`` / ``new_values`` (``kv_write=
    "runtime"``) are ``dtype`` like the pools they are stored in.

    ``Gemm(x, W, b)`` becomes ``Cast(Gemm(Cast(x), Cast(W), Cast(b)), float)`` (TensorRT folds
    the weight casts at build time, so the engine holds ``dtype`` weights); the op's query / key /
    value are cast to ``dtype``, its output back to float; the pools (inputs and their aliased
    outputs) are ``dtype`` tensors, what the kernels read and the runtime allocates.
    """
    import onnx
    from onnx import TensorProto, helper

    low = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[dtype]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph, nodes, casts = out.graph, [], {}

    def cast(name: str, to: int) -> str:
        key = (name, to)
        if key not in casts:
            casts[key] = f"{name}.to_{dtype if to == low else 'float'}"
            nodes.append(helper.make_node("Cast", [name], [casts[key]], to=to))
        return casts[key]

    for node in graph.node:
        if node.op_type in ("Gemm", "PagedAttention"):
            # Gemm: every input; PagedAttention: query/key/value and the attention bias
            floats = range(len(node.input)) if node.op_type == "Gemm" else [j for j in (0, 1, 2, _ATTN_BIAS)
                                                                              if j < len(node.input)]
            for j in floats:
                node.input[j] = cast(node.input[j], low)
            result = node.output[0]
            node.output[0] = f"{result}.{dtype}"
            nodes.append(node)
            nodes.append(helper.make_node("Cast", [node.output[0]], [result], to=TensorProto.FLOAT))
        else:
            nodes.append(node)
    for name in ("new_keys", "new_values"):               # kv_write="runtime": stored as the pools
        producer = next((n for n in nodes if name in n.output), None)
        if producer is not None:
            producer.output[list(producer.output).index(name)] = f"{name}.float"
            nodes.append(helper.make_node("Cast", [f"{name}.float"], [name], to=low))
    del graph.node[:]
    graph.node.extend(nodes)
    for value in list(graph.input) + list(graph.output):
        if "_cache" in value.name or value.name in ("new_keys", "new_values"):
            value.type.tensor_type.elem_type = low
    for function in out.functions:
        _type_generic(function)
    return out


def _type_generic(function) -> None:
    """Let the PagedAttention body run in the type of its inputs: the float constants it adds
    or multiplies (the softmax scale, the 0 / -inf mask bias) become ``CastLike`` the other
    operand."""
    from onnx import TensorProto, helper

    def is_float_const(node) -> bool:
        if node.op_type != "Constant":
            return False
        attr = node.attribute[0]
        return attr.name == "value_float" or (attr.name == "value" and attr.t.data_type == TensorProto.FLOAT)

    floats = {o for n in function.node if is_float_const(n) for o in n.output}
    floats |= {n.output[0] for n in function.node
               if n.op_type == "Where" and n.input[1] in floats and n.input[2] in floats}
    nodes = []
    for node in function.node:
        if node.op_type in ("Add", "Mul", "Sub", "Div"):
            for j, other in ((0, 1), (1, 0)):
                if node.input[j] in floats and node.input[other] not in floats:
                    like = f"{node.input[j]}_like_{node.output[0]}"
                    nodes.append(helper.make_node("CastLike", [node.input[j], node.input[other]], [like]))
                    node.input[j] = like
        nodes.append(node)
    del function.node[:]
    function.node.extend(nodes)


def _logger(trt):
    verbose = os.environ.get("TRTLLM_LITE_TRT_VERBOSE", "0") not in ("", "0")
    # ERROR by default: the parser warns once per inlined function node (duplicate node names).
    return trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.ERROR)


def build_plan(graph_path: str, backend: str, dtype: str, limits: ProfileLimits,
               kv_dims: tuple[int, int], num_layers: int) -> tuple[bytes, dict]:
    """Parse ``graph_path`` (the prefill graph) and build the serialized engine.

    Returns ``(plan bytes, manifest section)``.
    Raises:
        TensorRTUnavailable: the package is missing.
        RuntimeError: the parser or the builder failed (their messages included).
    """
    trt = import_tensorrt(backend)
    logger = _logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    plugin = None
    if backend == "tensorrt":
        plugin = register_plugin(trt)
        if hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE"):
            parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if not parser.parse_from_file(graph_path):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
        raise RuntimeError(f"{backend}: cannot parse {graph_path}: {errors}")
    config = builder.create_builder_config()
    if backend == "tensorrt":
        if hasattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03"):  # a preview feature in 10.x
            config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    elif hasattr(trt.PreviewFeature, "RUNTIME_ACTIVATION_RESIZE_10_10"):
        config.set_preview_feature(trt.PreviewFeature.RUNTIME_ACTIVATION_RESIZE_10_10, True)
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    profiles = {}
    for name in PROFILES:
        profile = builder.create_optimization_profile()
        shapes = {k: v for k, v in profile_shapes(name, limits, kv_dims, num_layers).items() if k in inputs}
        for tensor, (lo, opt, hi) in shapes.items():
            profile.set_shape(tensor, lo, opt, hi)
        config.add_optimization_profile(profile)
        profiles[name] = {k: [list(s) for s in v] for k, v in shapes.items()}
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"{backend}: the engine build failed for {graph_path} "
                           "(set TRTLLM_LITE_TRT_VERBOSE=1 for the builder's log)")
    section = {"plan": PLAN_FILE, "graph": os.path.basename(graph_path), "precision": dtype,
               "kv_write": KV_WRITE[backend], "profiles": profiles, "profile_index": {
                   name: i for i, name in enumerate(PROFILES)},
               "max_num_blocks": limits.max_num_blocks, "version": trt.__version__}
    if plugin is not None:
        section["plugin"] = {"name": "PagedAttention", "version": "1", "namespace": "trtllm_lite",
                             "implementation": plugin}
    return bytes(plan), section


def check_kv_cache_dtype(backend: str, kv_cache_dtype: str, dtype: str) -> None:
    """Refuse a ``kv_cache_dtype`` the TensorRT backends' pools do not hold.

    Their KV pools take the engine's precision (``--dtype``: the CUDA PagedAttention plugin
    and kernels read pools of the network's type, the in-op KV write stores that type), not a
    type of their own. So ``kv_cache_dtype`` may be the default float32 (the pools follow
    ``dtype``) or ``dtype`` itself (float16 with ``--dtype float16``); a float16 cache under
    float32 weights is the onnxruntime backend's option.

    Raises:
        ValueError: ``kv_cache_dtype`` is neither float32 nor ``dtype`` (names kv_cache_dtype).
    """
    if not tensorrt_kv_cache_dtype_ok(kv_cache_dtype, dtype):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} (--kv-cache-dtype) with --dtype {dtype!r}: the "
                         f"{backend} backend's KV pools take the engine's precision (--dtype "
                         f"{' or '.join(PRECISIONS[backend])}), which its CUDA PagedAttention kernels read; "
                         f"build with --dtype {kv_cache_dtype}, or use the onnxruntime backend for a "
                         f"{kv_cache_dtype} cache under {dtype} weights")


def compile_engine(output: str, backend: str, dtype: str, limits: ProfileLimits,
                   kv_dims: tuple[int, int], num_layers: int, log=None, kv_cache_dtype: str = "float32") -> dict:
    """Build ``output/model.plan`` from ``output/prefill.onnx`` (through its
    :func:`mixed_precision` copy ``prefill.<dtype>.onnx`` for 16-bit engines); return the
    manifest section.

    Raises:
        ValueError: ``kv_cache_dtype`` is neither float32 nor ``dtype``
            (:func:`check_kv_cache_dtype`), before any work and before TensorRT is imported.
    """
    import onnx

    check_kv_cache_dtype(backend, kv_cache_dtype, dtype)
    graph = os.path.join(output, "prefill.onnx")
    if dtype != "float32":
        typed = os.path.join(output, f"prefill.{dtype}.onnx")
        onnx.save(mixed_precision(onnx.load(graph, load_external_data=False), dtype), typed)
        onnx.checker.check_model(typed, full_check=True)
        graph = typed
    plan, section = build_plan(graph, backend, dtype, limits, kv_dims, num_layers)
    with open(os.path.join(output, PLAN_FILE), "wb") as f:
        f.write(plan)
    if log:
        log(f"{backend} engine {PLAN_FILE}: {len(plan) / 2**20:.1f} MiB, profiles {list(PROFILES)}")
    return section
