"""Weight-only block quantization onto ONNX Runtime's ``com.microsoft.MatMulNBits``.

``MatMulNBits`` (ONNX Runtime contrib op, version 1) computes ``Y = A @ dequant(B)^T``
with B block-quantized along K::

    A            [M, K]                            float32
    B            [N, ceil(K / bs), bs * bits / 8]  uint8, codes packed low bits first along K
    scales       [N, ceil(K / bs)]                 float32
    zero_points  [N * ceil(ceil(K / bs) * bits / 8)] uint8, packed the same way (optional;
                                                   absent means 2 ** (bits - 1))
    dequant(B)[n, k] = (code[n, k] - zero_point[n, k // bs]) * scale[n, k // bs]

A :class:`QuantizedLinear` holds those tensors for one ``[N, K]`` linear weight, plus
optional per-block ``offsets`` ``[N, ceil(K / bs)]`` float32 that the exporter adds as
``blocksum(A) @ offsets^T`` (one small GEMM): GGUF's Q4_1 stores ``w = d * q + m`` with a
float ``m`` per block, which no integer zero point expresses. With ``offsets = m``,
``scales = d`` and zero points 0 every number the GGUF stores is kept bit for bit: no
dequantize-then-requantize. (A float ``zero_points`` input ``-m / d`` would express it too,
but ONNX Runtime 1.32's CPU kernel then dequantizes the whole B to float32 on every call.)

ONNX Runtime 1.32's CPU kernels (measured here, :mod:`tools.bench`): 4-bit with float32
activations (``accuracy_level`` 0) has a fast packed kernel; 8-bit has one only with int8
activations (level 4), which changes results. So an 8-bit weight meant for level 0 is
stored **split** (:func:`split_8bit`), exactly: with ``u = 16 h + l`` (its two nibbles),
``s (u - z) = 16 s (h - 8) + s (l - 8) + s (136 - z)``, i.e. a 4-bit MatMulNBits over
``K' = 2K`` (``repeats = 2``: the exporter feeds it ``[A, A]``) with scales ``16 s`` for the
high-nibble blocks and ``s`` for the low ones, plus offsets ``s (136 - z)``.

GGUF block layouts (llama.cpp ``ggml-common.h``; 32 weights per block, little-endian)::

    Q4_0  18 bytes: d fp16, qs[16]            w[j] = d * (q[j] - 8)
    Q4_1  20 bytes: d fp16, m fp16, qs[16]    w[j] = d * q[j] + m
    Q8_0  34 bytes: d fp16, qs int8[32]       w[j] = d * qs[j]
    with 4-bit codes q[j] = qs[j] & 15 and q[j + 16] = qs[j] >> 4 for j < 16.

    Q4_K  144 bytes per 256 weights (llama.cpp's k-quants, the Q4_K_M files' main type):
          d fp16, dmin fp16, scales[12] (eight 6-bit scales sc and mins m), qs[128]
          sub-block b (32 weights): w[j] = (d * sc[b]) * q[j] - (dmin * m[b]); codes of
          sub-blocks 2c and 2c + 1 are the low and high nibbles of qs[32 c : 32 c + 32].
    So a Q4_K sub-block is a Q4_1 block with scale ``d * sc`` and offset ``-dmin * m`` (both
    exact in float32: 11 x 6 significant bits). Types of more than 4 bits (Q5_0, Q5_1, Q5_K,
    Q6_K: llama.cpp's "_M" files keep attn_v and ffn_down there) have no 4-bit form; an
    ``int4`` build gives them 8 bits, from their float values, rather than lose what the file
    kept (in a file of 4-bit linears; :func:`quantize_model`).

From float weights (:func:`quantize_weight`): symmetric blocks use the signed value of
largest magnitude ``v`` and ``scale = v / -2 ** (bits - 1)`` (llama.cpp's Q4_0 rule), so
the full code range is used; asymmetric blocks map ``[min(w, 0), max(w, 0)]`` onto
``[0, 2 ** bits - 1]`` with an integer zero point.

``w8a8`` is not weight-only: int8 weights with one scale per output channel
(:class:`W8A8Linear`, :func:`quantize_w8a8`) and int8 activations with one scale per token,
taken at run time (``builder.export_onnx``'s ``w8a8_linear``), for ONNX Runtime's integer GEMM
(``MatMulIntegerToFloat``; SmoothQuant's per-channel x per-token scheme without the smoothing,
Xiao et al. 2023, and vLLM's / TensorRT-LLM's W8A8 INT8). With ``activation_planes=2`` (the
default) each activation is two int8 codes, the second the first's rounding error x 254, so
only the weights' rounding is left. It trades exact arithmetic for the integer GEMM's rate in
batched steps (~6x float32's on this machine's AMX at 2048^3).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUANTIZATIONS = ("none", "int8", "int4", "w8a8")
BITS = {"int8": 8, "int4": 4}
W8A8 = "w8a8"   # int8 weights per output channel, int8 activations per token (not weight-only)
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}   # per GGUF_BLOCK_WEIGHTS
GGUF_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256}
#: GGUF types that store more than 4 bits a weight: an int4 build keeps them at 8 bits
GGUF_WIDER_THAN_4_BITS = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K")
GGUF_BLOCK = 32


@dataclass
class QuantizedLinear:
    """One ``[N, K]`` linear weight in MatMulNBits form (shapes in the module docstring).

    ``source`` says where the codes came from: ``"gguf:Q4_1"`` (exact) or ``"float"``.
    ``repeats``: the kernel reads the input ``repeats`` times over (``K' = repeats * K``,
    see :func:`split_8bit`); ``qweight``/``scales`` cover ``K'``, ``offsets`` cover ``K``.
    """

    n: int
    k: int
    bits: int
    block_size: int
    qweight: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None = None
    offsets: np.ndarray | None = None
    source: str = "float"
    repeats: int = 1

    @property
    def kernel_k(self) -> int:
        """K of the MatMulNBits node (``repeats * k``)."""
        return self.repeats * self.k

    @property
    def num_blocks(self) -> int:
        """Blocks per row of ``qweight`` / ``scales``."""
        return -(-self.kernel_k // self.block_size)

    @property
    def num_offset_blocks(self) -> int:
        """Blocks per row of the input (and of ``offsets``)."""
        return -(-self.k // self.block_size)

    def stored_tensors(self) -> dict[str, np.ndarray]:
        """Suffix -> array, as the weight store keeps them (``{name}.{suffix}``)."""
        parts = {"qweight": self.qweight, "scales": self.scales, "zero_points": self.zero_points,
                 "offsets": self.offsets}
        return {k: v for k, v in parts.items() if v is not None}

    def codes(self) -> np.ndarray:
        """Unpacked codes ``[N, num_blocks * block_size]`` uint8."""
        return unpack_codes(self.qweight, self.bits).reshape(self.n, -1)

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` weight this stands for (float64 arithmetic, then rounded)."""
        nb, bs = self.num_blocks, self.block_size
        q = self.codes().reshape(self.n, nb, bs).astype(np.float64)
        if self.zero_points is None:
            zp = np.full((self.n, nb), 2 ** (self.bits - 1), np.float64)
        else:
            per_row = -(-nb * self.bits // 8)
            zp = unpack_codes(self.zero_points.reshape(self.n, per_row), self.bits)[:, :nb].astype(np.float64)
        w = ((q - zp[..., None]) * self.scales.astype(np.float64)[..., None]).reshape(self.n, -1)
        w = sum(w[:, r * self.k:(r + 1) * self.k] for r in range(self.repeats))
        if self.offsets is not None:
            w += np.repeat(self.offsets.astype(np.float64), bs, axis=1)[:, :self.k]
        return w.astype(np.float32)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint8 codes ``[..., L]`` (values < 2 ** bits) into bytes, low bits first.

    4-bit: byte ``i`` holds ``codes[2i] | codes[2i + 1] << 4`` (``L`` is padded to even).
    """
    codes = codes.astype(np.uint8, copy=False)
    if bits == 8:
        return codes
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), np.uint8)], axis=-1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: ``[..., B]`` bytes -> ``[..., B * 8 / bits]`` codes."""
    if bits == 8:
        return packed
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def quantize_weight(w: np.ndarray, bits: int, block_size: int = 32, symmetric: bool = True
                    ) -> QuantizedLinear:
    """Block-quantize a float ``[N, K]`` weight for MatMulNBits (rules in the module docstring).

    Raises:
        ValueError: ``bits`` not 4/8, or ``block_size`` not a power of two >= 16.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    n, k = w.shape
    nb = -(-k // block_size)
    blocks = np.zeros((n, nb * block_size), np.float32)
    blocks[:, :k] = w
    blocks = blocks.reshape(n, nb, block_size)
    top = 2 ** bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        idx = np.abs(blocks).argmax(axis=-1)[..., None]
        scales = np.take_along_axis(blocks, idx, axis=-1)[..., 0] / -half
        inv = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales != 0)
        codes = np.clip(np.rint(blocks * inv[..., None]) + half, 0, top).astype(np.uint8)
        zero_points = None
    else:
        lo, hi = np.minimum(blocks.min(axis=-1), 0), np.maximum(blocks.max(axis=-1), 0)
        scales = (hi - lo) / top
        inv = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales != 0)
        zp = np.clip(np.rint(-lo * inv), 0, top).astype(np.uint8)
        codes = np.clip(np.rint(blocks * inv[..., None]) + zp[..., None], 0, top).astype(np.uint8)
        zero_points = pack_codes(zp, bits).reshape(-1)
    return QuantizedLinear(n, k, bits, block_size, pack_codes(codes, bits),
                           scales.astype(np.float32), zero_points)


def split_8bit(q: QuantizedLinear) -> QuantizedLinear:
    """The same 8-bit weight as a 4-bit MatMulNBits over ``[A, A]`` (module docstring), exactly.

    Raises:
        ValueError: ``q`` is not 8-bit, already has offsets, or K is not a multiple of the block.
    """
    if q.bits != 8 or q.offsets is not None or q.repeats != 1 or q.k % q.block_size:
        raise ValueError("split_8bit needs an 8-bit weight without offsets whose K is a multiple "
                         f"of its block size (bits {q.bits}, K {q.k}, block {q.block_size})")
    nb, bs = q.num_blocks, q.block_size
    u = q.codes().reshape(q.n, nb, bs)
    zp = (np.full((q.n, nb), 128.0) if q.zero_points is None
          else q.zero_points.reshape(q.n, nb).astype(np.float64))
    codes = np.concatenate([u >> 4, u & 15], axis=1)                       # [N, 2 nb, bs]
    scales = np.concatenate([16 * q.scales, q.scales], axis=1)
    offsets = (q.scales.astype(np.float64) * (136.0 - zp)).astype(np.float32)
    return QuantizedLinear(q.n, q.k, 4, bs, pack_codes(codes, 4), scales.astype(np.float32),
                           offsets=offsets, source=q.source + "+split", repeats=2)


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    return raw[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _gguf_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF 4-bit block codes ``[..., 16]`` bytes -> ``[..., 32]`` codes in weight order."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def from_gguf(tensor_type: str, raw: np.ndarray, k: int) -> QuantizedLinear:
    """Map a GGUF quantized weight exactly onto MatMulNBits (block size 32).

    Args:
        tensor_type: ``"Q4_0"``, ``"Q4_1"``, ``"Q8_0"`` or ``"Q4_K"``.
        raw: the tensor's bytes ``[N, K / block_weights * block_bytes]`` uint8 (rows = output
            features; 32 weights a block, 256 for Q4_K).
        k: in-features (a multiple of the type's block: 32, or 256 for Q4_K).
    Raises:
        ValueError: another tensor type, or a shape that does not match it.
    """
    if tensor_type not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF tensor type {tensor_type} has no exact MatMulNBits mapping; "
                         f"supported: {sorted(GGUF_BLOCK_BYTES)}")
    per_block = GGUF_BLOCK_WEIGHTS[tensor_type]
    n, nb = raw.shape[0], k // per_block
    if k % per_block or raw.shape[1] != nb * GGUF_BLOCK_BYTES[tensor_type]:
        raise ValueError(f"{tensor_type} tensor of {raw.shape[1]} bytes per row does not hold K={k}")
    blocks = raw.reshape(n, nb, GGUF_BLOCK_BYTES[tensor_type])
    if tensor_type == "Q4_K":
        return _from_q4_k(blocks, n, k)
    if tensor_type == "Q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return QuantizedLinear(n, k, 8, GGUF_BLOCK, codes, _f16(blocks, 0), source="gguf:Q8_0")
    if tensor_type == "Q4_0":
        codes = _gguf_nibbles(blocks[..., 2:])
        return QuantizedLinear(n, k, 4, GGUF_BLOCK, pack_codes(codes, 4), _f16(blocks, 0),
                               source="gguf:Q4_0")
    codes = _gguf_nibbles(blocks[..., 4:])
    zero_points = np.zeros(n * -(-nb // 2), np.uint8)
    return QuantizedLinear(n, k, 4, GGUF_BLOCK, pack_codes(codes, 4), _f16(blocks, 0),
                           zero_points, _f16(blocks, 2), source="gguf:Q4_1")


def _from_q4_k(blocks: np.ndarray, n: int, k: int) -> QuantizedLinear:
    """Q4_K super-blocks ``[N, K / 256, 144]`` uint8 as 4-bit blocks of 32 with offsets
    (module docstring); the 6-bit scales and mins unpacked by gguf-py's own reader."""
    from gguf.quants import Q4_K

    nsb = k // 256
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)                               # [N, K / 256]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scales = d[..., None] * sc.reshape(n, nsb, 8).astype(np.float32)        # exact in float32
    offsets = -(dmin[..., None] * m.reshape(n, nsb, 8).astype(np.float32))
    qs = blocks[..., 16:].reshape(n, nsb, 4, 1, 32)
    codes = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & np.uint8(15)   # [N, nsb, 4, 2, 32]
    nb = nsb * 8
    zero_points = np.zeros(n * -(-nb // 2), np.uint8)
    return QuantizedLinear(n, k, 4, GGUF_BLOCK, pack_codes(codes.reshape(n, nb, GGUF_BLOCK), 4), scales.reshape(n, nb),
                           zero_points, offsets.reshape(n, nb), source="gguf:Q4_K")


@dataclass
class W8A8Linear:
    """One ``[N, K]`` linear weight for the W8A8 integer GEMM: ``weight [K, N]`` int8 codes in
    ``[-127, 127]`` (transposed, as ``MatMulIntegerToFloat``'s B), ``scales [N]`` float32,
    ``w[n, k] = weight[k, n] * scales[n]``. ``activation_planes``: the int8 planes its input
    is quantized to per token (1: W8A8's ~8 bits; 2: a second plane holds the first's
    rounding error, ~15 bits, for twice the integer GEMM rows; ``builder.fused_ops``'
    ``QuantizeRows``)."""

    n: int
    k: int
    weight: np.ndarray
    scales: np.ndarray
    source: str = "float"
    activation_planes: int = 2

    def stored_tensors(self) -> dict[str, np.ndarray]:
        """Suffix -> array, as the weight store keeps them (``{name}.{suffix}``)."""
        return {"int8_weight": self.weight, "channel_scales": self.scales}

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` weight this stands for."""
        return (self.weight.astype(np.float32) * self.scales[None, :]).T.copy()


def quantize_w8a8(w: np.ndarray, activation_planes: int = 2) -> W8A8Linear:
    """Symmetric int8 codes for a float ``[N, K]`` weight, one scale per output channel
    (row): ``scale = max |w[n]| / 127`` (1 for an all-zero row), codes ``rint(w / scale)``.

    Raises:
        ValueError: ``w`` is not 2-D, or ``activation_planes`` is not 1 or 2.
    """
    if activation_planes not in (1, 2):
        raise ValueError(f"--activation-planes must be 1 or 2, got {activation_planes}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_w8a8 takes a [N, K] weight, got shape {w.shape}")
    top = np.abs(w).max(axis=1).astype(np.float64)
    scales = np.where(top > 0, top / 127.0, 1.0)
    codes = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return W8A8Linear(w.shape[0], w.shape[1], np.ascontiguousarray(codes.T), scales.astype(np.float32),
                      activation_planes=activation_planes)


def linear_weight_names(config, include_lm_head: bool) -> list[str]:
    """Canonical names of the weights a linear layer (GEMM) reads; ``embed.weight`` stands
    for a tied lm_head."""
    per_layer = ("qkv", "o", "up", "down") if config.family == "gpt2" else ("qkv", "o", "gate_up", "down")
    names = [f"layers.{i}.{x}.weight" for i in range(config.num_layers) for x in per_layer]
    if include_lm_head:
        names.append("embed.weight" if config.tie_word_embeddings else "lm_head.weight")
    return names


def quantize_model(loaded, quantization: str, block_size: int = 32, symmetric: bool = True,
                   quantize_lm_head: bool | None = None, accuracy_level: int = 0, log=None,
                   activation_planes: int = 2) -> dict[str, QuantizedLinear | W8A8Linear]:
    """Choose and quantize the linear weights of a :class:`~builder.loaders.LoadedModel`.

    ``w8a8``: every linear weight (the lm_head only when ``quantize_lm_head`` is true) to
    :func:`quantize_w8a8` with ``activation_planes``, from its float values. The others:

    A weight the GGUF stores in a type of the requested width (Q4_0/Q4_1/Q4_K for ``int4``,
    Q8_0 for ``int8``) is mapped exactly (:func:`from_gguf`, block size 32); any other is
    block-quantized from its float values (:func:`quantize_weight`). In an ``int4`` build of
    a 4-bit GGUF (one whose linears include Q4_0/Q4_1/Q4_K), a weight the file keeps in a
    wider type (:data:`GGUF_WIDER_THAN_4_BITS`) gets 8 bits (a Q8_0 one mapped exactly): a
    Q4_K_M file's Q6_K attn_v and ffn_down keep their precision. The lm_head (tied
    embedding or not): ``True`` quantizes it, ``False`` keeps it float32, ``None`` (default)
    quantizes it only when the GGUF stores it in a type that maps exactly (Q8_0, Q4_0, Q4_1,
    Q4_K at block size 32), so it keeps the very values of the float engine built from that file,
    or, in an ``int4`` build of a 4-bit file, in a wider type (8 bits, as the weights above). 8-bit weights are stored
    split (:func:`split_8bit`) unless ``accuracy_level`` is 4 (int8 activations) or their K is
    not a multiple of the block.

    Returns:
        canonical weight name -> :class:`QuantizedLinear` (empty for ``"none"``).
    Raises:
        ValueError: unknown ``quantization``, or a bad ``block_size``.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization!r}: choose from {QUANTIZATIONS}")
    if quantization == "none":
        return {}
    if quantization == W8A8:   # float weights requantized per channel (a GGUF's blocks included)
        out = {name: quantize_w8a8(loaded.weights[name], activation_planes)
               for name in linear_weight_names(loaded.config, bool(quantize_lm_head))}
        if log:
            log(f"quantized {len(out)} linear weights to int8 per output channel, activations to "
                f"{activation_planes} int8 plane{'s' if activation_planes > 1 else ''} per token at run time (w8a8)")
        return out
    bits = BITS[quantization]
    raw = loaded.extra.get("gguf_raw", {})
    exact = {4: ("Q4_0", "Q4_1", "Q4_K"), 8: ("Q8_0",)}[bits]
    # a 4-bit file: its layers' linears include 4-bit types
    mixed = bits == 4 and any(raw.get(name, (None,))[0] in exact
                              for name in linear_weight_names(loaded.config, False))
    if quantize_lm_head is None:
        head = raw.get("embed.weight" if loaded.config.tie_word_embeddings else "lm_head.weight", (None,))[0]
        # (a Q4_K_M file's Q6_K output.weight: 8 bits, not float32, 4x its bytes in every decode step)
        quantize_lm_head = block_size == GGUF_BLOCK and (head in GGUF_BLOCK_BYTES or
                                                         mixed and head in GGUF_WIDER_THAN_4_BITS)
    out, counts = {}, {}
    names = linear_weight_names(loaded.config, quantize_lm_head)
    for name in names:
        kind, data = raw.get(name, (None, None))
        w = loaded.weights[name]
        head_q8 = kind == "Q8_0" and name in ("embed.weight", "lm_head.weight")  # stays 8-bit, exactly
        # a 4-bit file kept this one (or a part of it: "Q4_K+Q6_K", a fused qkv) above 4 bits
        wider = mixed and any(part in GGUF_WIDER_THAN_4_BITS for part in (kind or "").split("+"))
        if (kind in exact or head_q8 or wider and kind == "Q8_0") and block_size == GGUF_BLOCK:
            out[name] = from_gguf(kind, data, w.shape[1])
        else:
            out[name] = quantize_weight(w, 8 if wider else bits, block_size, symmetric)
        if out[name].bits == 8 and accuracy_level < 4 and out[name].k % out[name].block_size == 0:
            out[name] = split_8bit(out[name])
        what = out[name].source + (f" ({kind} in the GGUF: 8-bit)" if wider and kind != "Q8_0" else "")
        counts[what] = counts.get(what, 0) + 1
    if log:
        log(f"quantized {len(out)} linear weights to {quantization} ("
            + ", ".join(f"{n} from {s}" for s, n in sorted(counts.items())) + ")")
    return out
