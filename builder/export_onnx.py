"""Export a decoder-only model into the **prefill** and **decode** ONNX graphs.

Both graphs take packed tokens (no padding tokens are computed) and the paged-KV metadata,
and share one external weights file. Graph I/O (``T`` tokens, ``S`` sequences)::

    inputs   input_ids        [T]                int64
             positions        [T]                int64   position of each token in its sequence
             slot_mapping     [T]                int64   flat KV pool slot of each token
             block_tables     [S, max_blocks]    int64
             context_lens     [S]                int64   tokens already cached before the step
             query_start_loc  [S + 1]            int64
             logits_indices   [N]                int64   (prefill only) tokens whose logits to return
             key_cache.{i}, value_cache.{i}  [num_blocks, block_size, num_kv_heads, head_dim]
                              float32 or float16 (build's kv_cache_dtype)
    outputs  logits           [N, vocab] (prefill) / [S, vocab] (decode)  float32
             new_keys, new_values  [num_layers, T, num_kv_heads, head_dim]  float32
                              the step's K/V, which the runtime stores at slot_mapping
                              (rounding them to float16 for float16 pools)

In decode, ``T == S`` and ``query_start_loc == arange(S + 1)``.

``kv_write="in_op"`` (the TensorRT graphs, :mod:`builder.compile_tensorrt`): no ``new_keys`` /
``new_values``; each PagedAttention node writes its layer's K/V into the pools itself and also
returns them as ``key_cache_out.{i}`` / ``value_cache_out.{i}`` (graph outputs; the TensorRT
plugin aliases them to the pool inputs, the runtime binds both to the same device buffer).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .model_config import ModelConfig
from .onnx_graph import MS_DOMAIN, OPSET, NodeWriter, WeightStore
from .fused_ops import (BLOCK_HADAMARD_OP_TYPE, DEQUANTIZE_ROWS_OP_TYPE, OFFSETS_OP_TYPE, QUANTIZE_ROWS_OP_TYPE,
                        QUANTIZED_LINEAR_OFFSETS_OP_TYPE, QUANTIZED_LINEAR_OP_TYPE, QUANTIZED_LINEAR_SPLIT8_OP_TYPE,
                        ROTARY_OP_TYPE, SILU_OP_TYPE, SKIP_NORM_OP_TYPE, make_block_hadamard_function,
                        make_dequantize_rows_function, make_offsets_function, make_quantize_rows_function,
                        make_quantized_linear_functions, make_rotary_function, make_silu_function,
                        make_skip_norm_function)
from .paged_attention import (DOMAIN, OP_TYPE, check_kv_cache_dtype_name, make_onnx_function, make_onnx_functions,
                              write_attention_metadata)
from .quantize import QuantizedLinear, W8A8Linear, pack_codes
from .rotation import DOWN_ROTATION


GRAPH_INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens",
                "query_start_loc")


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies ``[head_dim / 2]`` float64, with linear / llama3 scaling.

    Source: RoFormer (Su et al. 2021); llama3 scaling as in Meta's Llama 3.1 reference code.
    """
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = config.rope_scaling
    if not s:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    if s["rope_type"] == "freq_factors":   # GGUF rope_freqs.weight: llama.cpp divides each frequency
        return inv / np.asarray(s["factors"], np.float64)
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * np.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


KV_WRITES = ("runtime", "in_op")  # who stores the step's K/V: the runtime, or the op itself


def in_op_function() -> onnx.FunctionProto:
    """The PagedAttention function with two more outputs, the pools after the op's KV write.

    ``key_cache_out = ScatterND(key_cache viewed [num_blocks * block_size, Hkv, D],
    slot_mapping[:, None], key)`` (likewise V), on top of :func:`make_onnx_function`'s
    attention body. This body defines the in-place op's meaning in ONNX (onnx.checker, ONNX
    Runtime check it); TensorRT runs the plugin instead, which writes only the step's slots.
    """
    fn = make_onnx_function()
    w = NodeWriter("pa_kv_")
    q, k, v, kc, vc, slots = fn.input[:6]
    flat_shape = w.op("Concat", w.const([-1]), w.op("Shape", k, start=1), axis=0)   # [-1, Hkv, D]
    index = w.op("Unsqueeze", slots, w.const([1]))                                  # [T, 1]
    for pool, new, out in ((kc, k, "key_cache_out"), (vc, v, "value_cache_out")):
        flat = w.op("Reshape", pool, flat_shape)
        w.op("Reshape", w.op("ScatterND", flat, index, new), w.op("Shape", pool), outputs=[out])
    fn.node.extend(w.nodes)
    fn.output.extend(["key_cache_out", "value_cache_out"])
    return fn


class DecoderGraphWriter:
    """Writes one graph (prefill or decode) over the shared :class:`WeightStore`."""

    def __init__(self, config: ModelConfig, weights: WeightStore, max_seq_len: int, kind: str,
                 quantized: dict[str, QuantizedLinear] | None = None, accuracy_level: int = 0,
                 kv_write: str = "runtime", ort_ops: bool = False, kv_cache_dtype: str = "float32"):
        if kv_write not in KV_WRITES:
            raise ValueError(f"kv_write must be one of {KV_WRITES}, got {kv_write!r}")
        check_kv_cache_dtype_name(kv_cache_dtype)
        if kv_cache_dtype != "float32" and kv_write == "in_op":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: the in-op KV write graph (TensorRT) is "
                             "exported with float32 pools; a TensorRT engine's pools take its --dtype "
                             "(compile_tensorrt.mixed_precision)")
        self.kv_write, self.kv_cache_dtype = kv_write, kv_cache_dtype
        self.ort_ops = ort_ops and kv_write == "runtime"
        # the Llama family's ONNX Runtime graphs: RotarySplitQKV and SiluAndMul (fused_ops.py)
        self.fused_ops = self.ort_ops and config.family != "gpt2"
        self.cos_sin: tuple[str, str] | None = None   # the step's rotary rows (standard ops)
        self.c, self.weights, self.kind = config, weights, kind
        self.quantized, self.accuracy_level = quantized or {}, accuracy_level
        self.max_seq_len = max_seq_len
        self.w = NodeWriter()
        self.used: list[str] = []
        self.metadata: tuple[str, ...] = ()   # attention metadata, written once (runtime KV write)
        self.quantized_linear_ops = False     # QuantizedLinear nodes written (their functions go with them)
        self.quantize_rows_ops = False        # QuantizeRows nodes written (W8A8 linears)
        self.block_hadamard_ops = False       # BlockHadamard nodes written (--rotate-activations)

    def weight(self, name: str) -> str:
        if name not in self.weights.arrays:
            raise KeyError(f"weight {name!r} missing")
        if name not in self.used:
            self.used.append(name)
        return name

    def has(self, name: str) -> bool:
        return name in self.weights.arrays

    # -- building blocks ------------------------------------------------------------------
    def linear(self, x: str, prefix: str, outputs: int | list[str] = 1) -> str:
        """``x [T, in] @ W^T (+ b)`` with ``W [out, in]`` stored as the checkpoint keeps it.

        A quantized weight becomes ``com.microsoft.MatMulNBits`` (see :mod:`builder.quantize`)
        over ``x`` (``[x, x]`` for a split 8-bit weight), plus ``Gemm(blocksum(x), offsets,
        C=y)`` when its blocks carry float offsets (Q4_1, split 8-bit). In the ONNX Runtime
        graphs at accuracy level 0 a 4-bit weight is one ``QuantizedLinear`` (or
        ``QuantizedLinearWithOffsets``) node instead, whose C++ kernel replaces both
        (:mod:`builder.fused_ops`; a split 8-bit weight is ``QuantizedLinearSplit8`` over x once,
        computed as 8-bit); at other levels MatMulNBits + ``AddBlockOffsets``.
        """
        name, q = prefix + ".weight", self.quantized.get(prefix + ".weight")
        if q is None:
            args = [x, self.weight(name)]
            if self.has(prefix + ".bias"):
                args.append(self.weight(prefix + ".bias"))
            return self.w.op("Gemm", *args, transB=1, outputs=outputs)
        bias = self.weight(prefix + ".bias") if self.has(prefix + ".bias") else ""
        if isinstance(q, W8A8Linear):
            return self.w8a8_linear(x, name, q.activation_planes, bias, outputs)
        zp = self.weight(name + ".zero_points") if q.zero_points is not None else ""
        split8 = self.ort_ops and self.accuracy_level == 0 and q.repeats == 2   # x once, not [x, x]
        xin = x if q.repeats == 1 or split8 else self.w.op("Concat", *[x] * q.repeats, axis=1)
        if self.ort_ops and self.accuracy_level == 0 and q.bits == 4:
            self.quantized_linear_ops = True
            args = [xin, self.weight(name + ".qweight"), self.weight(name + ".scales"),
                    zp or self.default_zero_points(q.n, q.num_blocks)]
            op_type = QUANTIZED_LINEAR_OP_TYPE
            if q.offsets is not None:
                op_type = QUANTIZED_LINEAR_SPLIT8_OP_TYPE if split8 else QUANTIZED_LINEAR_OFFSETS_OP_TYPE
                args += [self.weight(name + ".offsets"),
                         self.block_sum_matrix(q.num_offset_blocks, q.block_size, q.kernel_k)]
            attrs = dict(N=q.n, K=q.kernel_k, block_size=q.block_size, domain=DOMAIN)
            if not bias:
                return self.w.op(op_type, *args, outputs=outputs, **attrs)
            return self.w.op("Add", self.w.op(op_type, *args, **attrs), bias, outputs=outputs)
        args = [xin, self.weight(name + ".qweight"), self.weight(name + ".scales"), zp, "", bias]
        while not args[-1]:
            args.pop()
        attrs = dict(K=q.kernel_k, N=q.n, bits=q.bits, block_size=q.block_size, domain=MS_DOMAIN,
                     accuracy_level=self.accuracy_level)
        if q.offsets is None:
            return self.w.op("MatMulNBits", *args, outputs=outputs, **attrs)
        y = self.w.op("MatMulNBits", *args, **attrs)
        block_sums = self.block_sum_matrix(q.num_offset_blocks, q.block_size)
        if self.ort_ops:    # one op, one C++ kernel where registered (fused_ops.py)
            return self.w.op(OFFSETS_OP_TYPE, y, x, self.weight(name + ".offsets"), block_sums, domain=DOMAIN,
                             block_size=q.block_size, outputs=outputs)
        sums = self.w.op("MatMul", x, block_sums)                                           # [T, blocks]
        return self.w.op("Gemm", sums, self.weight(name + ".offsets"), y, transB=1, outputs=outputs)

    def w8a8_linear(self, x: str, name: str, planes: int, bias: str, outputs: int | list[str]) -> str:
        """``x [T, K] float32`` through a :class:`~builder.quantize.W8A8Linear`: x quantized to
        ``planes`` uint8 planes per token (``QuantizeRows``, :mod:`builder.fused_ops`: codes
        ``q [planes T, K]``, zero point 128, ``scale [planes T, 1]``), ONNX Runtime's integer
        GEMM over every plane at once (``MatMulIntegerToFloat``: ``(q - 128) @ int8_weight *
        channel_scales``), then the planes scaled and summed [+ bias] (``DequantizeRows``).
        A token's result does not depend on the other tokens of the step."""
        w = self.w
        self.quantize_rows_ops = True
        if not self.has("w8a8.one"):
            self.weights.add("w8a8.one", np.array(1.0, np.float32))
            self.weights.add("w8a8.zero_point", np.array(128, np.uint8))
        q, scale = w.op(QUANTIZE_ROWS_OP_TYPE, x, domain=DOMAIN, outputs=2, planes=planes)
        y = w.op("MatMulIntegerToFloat", q, self.weight(name + ".int8_weight"), self.weight("w8a8.one"),
                 self.weight(name + ".channel_scales"), self.weight("w8a8.zero_point"), domain=MS_DOMAIN)
        n = self.weights.arrays[name + ".channel_scales"].shape[0]
        if not bias:   # (the op's bias is required: its function body cannot leave an input out)
            bias = f"w8a8.zero_bias.{n}"
            if not self.has(bias):
                self.weights.add(bias, np.zeros(n, np.float32))
            bias = self.weight(bias)
        return w.op(DEQUANTIZE_ROWS_OP_TYPE, y, scale, bias, domain=DOMAIN, planes=planes, outputs=outputs)

    def block_sum_matrix(self, num_blocks: int, block_size: int, rows: int | None = None) -> str:
        """``[rows, num_blocks]`` float32 of 0/1 (``rows`` defaults to ``num_blocks * block_size``;
        rows past the blocks are zero): ``x @ it`` sums each of the first ``num_blocks`` blocks
        of ``x``'s columns (one MatMul where Reshape + ReduceSum were two ops per linear;
        shared by every linear of that width)."""
        rows = num_blocks * block_size if rows is None else rows
        name = f"block_sum.{num_blocks}x{block_size}" + ("" if rows == num_blocks * block_size else f".{rows}")
        if not self.has(name):
            matrix = np.zeros((rows, num_blocks), np.float32)
            ones = np.repeat(np.eye(num_blocks, dtype=np.float32), block_size, axis=0)[:rows]
            matrix[:len(ones)] = ones
            self.weights.add(name, matrix)
        return self.weight(name)

    def default_zero_points(self, n: int, num_blocks: int) -> str:
        """MatMulNBits' implicit 4-bit zero points (8) as a tensor ``[n * ceil(num_blocks / 2)]``
        uint8, for ``QuantizedLinear``'s required input (shared by every weight of that shape)."""
        name = f"zero_points.4bit_default.{n}x{num_blocks}"
        if not self.has(name):
            self.weights.add(name, pack_codes(np.full((n, num_blocks), 8, np.uint8), 4).reshape(-1))
        return self.weight(name)

    def norm(self, x: str, prefix: str) -> str:
        w, eps = self.w, self.c.norm_eps
        if self.c.family == "gpt2":
            return w.op("LayerNormalization", x, self.weight(prefix + ".weight"),
                        self.weight(prefix + ".bias"), axis=-1, epsilon=eps)
        # RMSNorm (Zhang & Sennrich 2019) in the op pattern ONNX Runtime fuses into one
        # SimplifiedLayerNormalization (ORT's own skip fusion wants 3-D inputs, ours are packed
        # [T, hidden]: the ONNX Runtime graphs write the residual add + norm as one op
        # themselves, :meth:`skip_norm`)
        ms = w.op("ReduceMean", w.op("Pow", x, w.const(2.0, np.float32)), w.const([-1]), keepdims=1)
        rms = w.op("Sqrt", w.op("Add", ms, w.const(eps, np.float32)))
        return w.op("Mul", w.op("Div", x, rms), self.weight(prefix + ".weight"))

    def skip_norm(self, x: str, y: str, prefix: str) -> tuple[str, str]:
        """``(rmsnorm(x + y), x + y)`` as one ``trtllm_lite::SkipRMSNorm`` (:mod:`builder.fused_ops`:
        ONNX Runtime's ``SkipSimplifiedLayerNormalization`` as its body, the same bits from its
        C++ kernel, which sums several rows' squares side by side)."""
        w = self.w
        h, total = w.fresh("norm"), w.fresh("residual")
        w.op(SKIP_NORM_OP_TYPE, x, y, self.weight(prefix + ".weight"), domain=DOMAIN,
             epsilon=self.c.norm_eps, outputs=[h, total])
        return h, total

    def rope(self, x: str, cos: str, sin: str) -> str:
        """Rotate-half rotary embedding (RoFormer, Su et al. 2021) on ``x [T, heads, D]``.

        ``cos = [c, c]`` and ``sin = [-s, s]`` are ``[T, 1, D]`` (:meth:`rope_tables`), so
        ``x * cos + [x2, x1] * sin = [x1 c - x2 s, x2 c + x1 s]``: five ops.
        """
        w = self.w
        x1, x2 = w.op("Split", x, axis=-1, num_outputs=2, outputs=2)
        return w.op("Add", w.op("Mul", x, cos), w.op("Mul", w.op("Concat", x2, x1, axis=-1), sin))

    def rope_tables(self) -> tuple[str, str]:
        """The step's ``cos = [c, c]``, ``sin = [-s, s]`` ``[T, 1, D]`` rows at ``positions``."""
        w = self.w
        cos = w.op("Gather", self.weight("rope.cos"), "positions", axis=0)    # [T, D/2]
        sin = w.op("Gather", self.weight("rope.sin"), "positions", axis=0)
        return (w.op("Unsqueeze", w.op("Concat", cos, cos, axis=-1), w.const([1])),
                w.op("Unsqueeze", w.op("Concat", w.op("Neg", sin), sin, axis=-1), w.const([1])))

    def attention(self, i: int, x: str) -> tuple[str, str, str]:
        """Layer ``i``'s qkv projection, rotary embedding, PagedAttention and o_proj:
        ``(o_proj output [T, hidden], k [T, Hkv, D], v [T, Hkv, D])``."""
        c, w = self.c, self.w
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        if self.fused_ops:   # one op: rotary on the q and k heads, split into q, k, v (fused_ops.py)
            q, k, v = w.op(ROTARY_OP_TYPE, self.linear(x, f"layers.{i}.qkv"), "positions", self.weight("rope.cos"),
                           self.weight("rope.sin"), domain=DOMAIN, outputs=3, num_heads=hq, num_kv_heads=hkv)
            return self._paged_attention(i, q, k, v)
        qkv = w.op("Reshape", self.linear(x, f"layers.{i}.qkv"), w.const([-1, hq + 2 * hkv, d]))
        if self.cos_sin is None:   # no rotary (GPT-2)
            q, k, v = w.op("Split", qkv, w.const([hq, hkv, hkv]), axis=1, outputs=3)
        else:       # rotate q and k heads together
            qk, v = w.op("Split", qkv, w.const([hq + hkv, hkv]), axis=1, outputs=2)
            q, k = w.op("Split", self.rope(qk, *self.cos_sin), w.const([hq, hkv]), axis=1, outputs=2)
        return self._paged_attention(i, q, k, v)

    def _paged_attention(self, i: int, q: str, k: str, v: str) -> tuple[str, str, str]:
        """Layer ``i``'s PagedAttention node and o_proj: ``(o_proj output, k, v)``."""
        c, w = self.c, self.w
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        in_op = self.kv_write == "in_op"
        outs = [w.fresh("pa_out"), f"key_cache_out.{i}", f"value_cache_out.{i}"] if in_op else 1
        plugin = {"plugin_namespace": DOMAIN} if in_op else {}  # TensorRT's parser: use the plugin
        out = w.op(OP_TYPE, q, k, v, f"key_cache.{i}", f"value_cache.{i}", *GRAPH_INPUTS[2:],
                   *self.metadata, domain=DOMAIN, name=f"layers.{i}.paged_attention", outputs=outs,
                   num_heads=hq, num_kv_heads=hkv, scale=float(d) ** -0.5, **plugin)
        out = out[0] if in_op else out
        out = w.op("Reshape", out, w.const([-1, hq * d]))
        return self.linear(out, f"layers.{i}.o"), k, v

    def mlp(self, i: int, x: str) -> str:
        w = self.w
        if self.c.family == "gpt2":
            return self.linear(w.op("Gelu", self.linear(x, f"layers.{i}.up"), approximate="tanh"),
                               f"layers.{i}.down")
        if self.fused_ops:   # silu(gate) * up as one op (fused_ops.py)
            h = w.op(SILU_OP_TYPE, self.linear(x, f"layers.{i}.gate_up"), domain=DOMAIN)
        else:
            gate, up = w.op("Split", self.linear(x, f"layers.{i}.gate_up"), axis=1, num_outputs=2, outputs=2)
            h = w.op("Mul", w.op("Mul", gate, w.op("Sigmoid", gate)), up)
        if self.has(DOWN_ROTATION):   # --rotate-activations: the down input's online rotation (builder/rotation.py)
            self.block_hadamard_ops = True
            h = w.op(BLOCK_HADAMARD_OP_TYPE, h, self.weight(DOWN_ROTATION), domain=DOMAIN)
        return self.linear(h, f"layers.{i}.down")

    # -- the whole graph ------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        c, w = self.c, self.w
        x = w.op("Gather", self.weight("embed.weight"), "input_ids", axis=0)      # [T, hidden]
        if c.family == "gpt2":
            x = w.op("Add", x, w.op("Gather", self.weight("pos_embed.weight"), "positions", axis=0))
        elif not self.fused_ops:   # (RotarySplitQKV reads the cos/sin tables at the positions itself)
            self.cos_sin = self.rope_tables()
        if self.kv_write == "runtime":     # the TensorRT plugin's node keeps the 9 inputs
            block_size = w.op("Shape", "key_cache.0", start=1, end=2)
            self.metadata = write_attention_metadata(
                w, *GRAPH_INPUTS[3:], block_size, w.const([c.num_heads // c.num_kv_heads]),
                (c.num_heads, c.num_kv_heads) if self.ort_ops else None)
        new_keys, new_values = [], []
        fused_norms = self.ort_ops and c.family != "gpt2"   # residual add + RMSNorm in one op
        h = self.norm(x, "layers.0.attn_norm") if fused_norms else None
        for i in range(c.num_layers):
            if fused_norms:
                attn, k, v = self.attention(i, h)
                h, x = self.skip_norm(x, attn, f"layers.{i}.mlp_norm")
                following = f"layers.{i + 1}.attn_norm" if i + 1 < c.num_layers else "final_norm"
                h, x = self.skip_norm(x, self.mlp(i, h), following)
            else:
                attn, k, v = self.attention(i, self.norm(x, f"layers.{i}.attn_norm"))
                x = w.op("Add", x, attn)
                x = w.op("Add", x, self.mlp(i, self.norm(x, f"layers.{i}.mlp_norm")))
            if self.kv_write == "runtime":
                new_keys.append(k)
                new_values.append(v)
        if self.kv_write == "runtime":   # [L * T, Hkv, D] -> [L, T, Hkv, D]: one op, not one per layer
            layers = w.const([c.num_layers, -1, c.num_kv_heads, c.head_dim])
            w.op("Reshape", w.op("Concat", *new_keys, axis=0), layers, outputs=["new_keys"])
            w.op("Reshape", w.op("Concat", *new_values, axis=0), layers, outputs=["new_values"])
        if not fused_norms:
            h = x
        if self.kind == "prefill":
            h = w.op("Gather", h, "logits_indices", axis=0)
        if not fused_norms:
            h = self.norm(h, "final_norm")
        lm_head = "embed.weight" if c.tie_word_embeddings else "lm_head.weight"
        self.linear(h, lm_head.removesuffix(".weight"), outputs=["logits"])
        return self._model()

    def _model(self) -> onnx.ModelProto:
        c = self.c
        f32, i64 = TensorProto.FLOAT, TensorProto.INT64
        kv = [c.num_kv_heads, c.head_dim]
        pool_type = TensorProto.FLOAT16 if self.kv_cache_dtype == "float16" else f32
        inputs = [helper.make_tensor_value_info("input_ids", i64, ["num_tokens"]),
                  helper.make_tensor_value_info("positions", i64, ["num_tokens"]),
                  helper.make_tensor_value_info("slot_mapping", i64, ["num_tokens"]),
                  helper.make_tensor_value_info("block_tables", i64, ["num_seqs", "max_blocks_per_seq"]),
                  helper.make_tensor_value_info("context_lens", i64, ["num_seqs"]),
                  helper.make_tensor_value_info("query_start_loc", i64, ["num_seqs_plus_1"])]
        if self.kind == "prefill":
            inputs.append(helper.make_tensor_value_info("logits_indices", i64, ["num_logits"]))
        for i in range(c.num_layers):
            for name in (f"key_cache.{i}", f"value_cache.{i}"):
                inputs.append(helper.make_tensor_value_info(name, pool_type, ["num_blocks", "block_size", *kv]))
        rows = "num_logits" if self.kind == "prefill" else "num_seqs"
        outputs = [helper.make_tensor_value_info("logits", f32, [rows, c.vocab_size]),
                   helper.make_tensor_value_info("new_keys", f32, [c.num_layers, "num_tokens", *kv]),
                   helper.make_tensor_value_info("new_values", f32, [c.num_layers, "num_tokens", *kv])]
        if self.kv_write == "in_op":
            outputs[1:] = [helper.make_tensor_value_info(f"{name}_out.{i}", f32, ["num_blocks", "block_size", *kv])
                           for i in range(c.num_layers) for name in ("key_cache", "value_cache")]
        graph = helper.make_graph(self.w.nodes, self.kind, inputs, outputs,
                                  initializer=self.weights.initializer_protos(self.used))
        opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)]
        if self.quantized or self.ort_ops:
            opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
        functions = (make_onnx_functions(heads=(c.num_heads, c.num_kv_heads, c.head_dim),
                                         decode_path=self.ort_ops, kv_cache_dtype=self.kv_cache_dtype)
                     if self.kv_write == "runtime" else [in_op_function()])
        if self.fused_ops:
            functions += [make_rotary_function(c.num_heads, c.num_kv_heads, c.head_dim), make_silu_function(),
                          make_skip_norm_function(c.norm_eps)]
        if self.ort_ops and any(getattr(q, "offsets", None) is not None for q in self.quantized.values()):
            functions.append(make_offsets_function())
        if self.quantized_linear_ops:
            functions += make_quantized_linear_functions()
        if self.quantize_rows_ops:
            functions += [make_quantize_rows_function(), make_dequantize_rows_function()]
        if self.block_hadamard_ops:
            functions.append(make_block_hadamard_function())
        model = helper.make_model(graph, opset_imports=opsets, functions=functions,
                                  producer_name="trtllm-lite")
        model.ir_version = 10
        return model


def add_rope_tables(config: ModelConfig, weights: WeightStore, max_seq_len: int) -> None:
    """Precompute cos/sin ``[max_seq_len, head_dim / 2]`` float32 into the weight store."""
    if config.family == "gpt2":
        return
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), rope_inv_freq(config))
    weights.add("rope.cos", np.cos(angles).astype(np.float32))
    weights.add("rope.sin", np.sin(angles).astype(np.float32))


def export_graphs(config: ModelConfig, weights: dict[str, np.ndarray], max_seq_len: int,
                  quantized: dict[str, QuantizedLinear] | None = None, accuracy_level: int = 0,
                  kv_write: str = "runtime", ort_ops: bool = False, kv_cache_dtype: str = "float32"
                  ) -> tuple[dict[str, onnx.ModelProto], WeightStore]:
    """Build the prefill and decode graphs over one weight store.

    Args:
        config: the model.
        weights: canonical float32 weights (see :mod:`builder.loaders`).
        max_seq_len: longest sequence (prompt + output) the engine serves, tokens.
        quantized: canonical linear weight name -> its MatMulNBits form (replaces the float
            weight, except ``embed.weight``, whose float table the embedding Gather keeps).
        accuracy_level: MatMulNBits ``accuracy_level`` attribute (0/1: float32 arithmetic;
            4: int8 activations).
        kv_write: ``"runtime"`` (graphs return ``new_keys``/``new_values``; ONNX Runtime,
            TensorRT-RTX) or ``"in_op"`` (the op writes the pools; TensorRT), module docstring.
        ort_ops: graphs that only ONNX Runtime runs (its backend's): the PagedAttention body
            gets its decode path (:func:`~builder.paged_attention.make_onnx_function`), and
            ONNX Runtime's fused ``RotaryEmbedding`` and ``SkipSimplifiedLayerNormalization``
            (residual add + RMSNorm; the Llama family's as ``SkipRMSNorm``, whose body it is)
            replace their standard-op spelling.
        kv_cache_dtype: the pools' type, ``"float32"`` or ``"float16"`` (the graphs'
            ``key_cache.{i}`` / ``value_cache.{i}`` inputs; the attention body casts what it
            gathers from float16 pools to float32). ``kv_write="in_op"`` takes float32 only.
    Returns:
        ``({"prefill": model, "decode": model}, store)``; write the store with ``store.write``.
    """
    quantized = quantized or {}
    store = WeightStore()
    for name, arr in weights.items():
        if name not in quantized or name == "embed.weight":
            store.add(name, arr.astype(np.float32, copy=False))
    for name, q in quantized.items():
        for part, arr in q.stored_tensors().items():
            store.add(f"{name}.{part}", arr)
    add_rope_tables(config, store, max_seq_len)
    if config.family == "gpt2" and max_seq_len > config.max_position_embeddings:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds GPT-2's learned positions "
                         f"({config.max_position_embeddings})")
    graphs = {kind: DecoderGraphWriter(config, store, max_seq_len, kind, quantized, accuracy_level,
                                       kv_write, ort_ops, kv_cache_dtype).build()
              for kind in ("prefill", "decode")}
    return graphs, store
