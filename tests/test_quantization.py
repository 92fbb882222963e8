"""Weight-only quantization: exact GGUF block mapping, the MatMulNBits layout ONNX Runtime
reads, and quantized engines against float references (the fp32 engine, HF transformers)."""
import json
import os

import numpy as np
import onnxruntime as ort
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from onnx import TensorProto, helper

from builder.build import BuildConfig
from builder.export_onnx import DecoderGraphWriter
from builder.loaders import load_model
from builder.model_config import ModelConfig
from builder.onnx_graph import OPSET, WeightStore
from builder.quantize import from_gguf, quantize_model, quantize_w8a8, quantize_weight, split_8bit
from builder.rotation import DOWN_ROTATION, rotate_activations
from trtllm_lite import LLM, SamplingParams
from trtllm_lite.runners.base import ScheduledSeq, StepBatch

from .conftest import SMOLLM2, build, profile_prefix

GGUF_TYPES = ["Q4_0", "Q4_1", "Q8_0"]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def random_weight(n=48, k=96, seed=0):
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


def random_k_quant(kind, n, k, seed=0):
    """``[n, k]`` weights of llama.cpp k-quant ``kind`` (Q4_K, Q6_K) as raw bytes: random
    codes, 6-bit scales and mins, with a sane fp16 ``d`` (and ``dmin``); gguf-py reads them
    but cannot write them."""
    rng = np.random.default_rng(seed)
    size, d_at = {"Q4_K": (144, 0), "Q6_K": (210, 208)}[kind]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    blocks[..., d_at:d_at + 2] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    if kind == "Q4_K":
        blocks[..., 2:4] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)      # dmin
    else:
        blocks[..., 192:208] = rng.integers(-8, 8, (n, k // 256, 16)).astype(np.int8).view(np.uint8)
    return blocks.reshape(n, -1)


def gguf_block(kind, w):
    gtype = GGMLQuantizationType[kind]
    raw = random_k_quant(kind, *w.shape) if kind.endswith("_K") else gguf_quantize(w, gtype)
    return raw, gguf_dequantize(raw, gtype).astype(np.float32)


@pytest.mark.parametrize("kind", GGUF_TYPES + ["Q4_K"])
def test_gguf_blocks_map_bit_exactly(kind):
    k = 512 if kind == "Q4_K" else 96       # Q4_K: super-blocks of 256, as 4-bit blocks of 32 with offsets
    raw, reference = gguf_block(kind, random_weight(k=k))
    q = from_gguf(kind, raw, k)
    assert q.block_size == 32 and q.bits == (8 if kind == "Q8_0" else 4)
    np.testing.assert_array_equal(q.dequantize(), reference)


def test_gguf_type_without_exact_mapping_is_refused():
    with pytest.raises(ValueError, match="Q5_K"):
        from_gguf("Q5_K", np.zeros((2, 176), np.uint8), 256)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_block_quantization_error_within_one_step(bits, symmetric):
    w = random_weight(k=100)  # K not a multiple of the block: the last block is padded
    q = quantize_weight(w, bits, 32, symmetric)
    step = np.repeat(np.abs(q.scales), 32, axis=1)[:, :100]
    err = np.abs(q.dequantize() - w)
    assert (err <= step * (1.0 if symmetric else 0.5) + 1e-6).all()   # symmetric: +2^(b-1) clips


def run_linear(q, x, accuracy_level=0, library=False):
    """Run the exporter's own ``linear`` for ``q`` through ONNX Runtime (prepacking on, as
    the runner sets it for quantized engines). ``library`` other than False: the ONNX Runtime
    graphs' form (``ort_ops``), a 4-bit weight as one ``QuantizedLinear`` node, with the
    kernel library at that path registered (``None``: its function body runs); returns the
    output and the op types that ran."""
    ort_ops = library is not False
    model = linear_model(q, accuracy_level, ort_ops)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1 if not ort_ops else 2
    if ort_ops:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix()
        if library:
            so.register_custom_ops_library(library)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    if not ort_ops:
        return sess.run(None, {"a": x})[0]
    y = [sess.run(None, {"a": x})[0] for _ in range(2)]   # the kernel repacks once, on the first call
    np.testing.assert_array_equal(y[0], y[1])
    path = sess.end_profiling()
    with open(path) as f:
        ran = {e["args"].get("op_name") for e in json.load(f) if e.get("cat") == "Node"}
    os.remove(path)
    return y[0], ran


def linear_model(q, accuracy_level=0, ort_ops=True):
    """The ONNX model of the exporter's own ``linear`` for ``q``: input ``a`` [T, K], output
    ``y`` [T, N] float32 (``ort_ops``: the kernels' graph form, one ``QuantizedLinear`` node)."""
    from builder.fused_ops import make_offsets_function, make_quantized_linear_functions
    from builder.paged_attention import DOMAIN

    config = ModelConfig("LlamaForCausalLM", "llama", 1, q.k, 1, 1, q.k, 1, 1, 1)
    store = WeightStore()
    for part in ("qweight", "scales", "zero_points", "offsets"):
        if getattr(q, part) is not None:
            store.add(f"x.weight.{part}", getattr(q, part))
    writer = DecoderGraphWriter(config, store, 1, "decode", {"x.weight": q}, accuracy_level, ort_ops=ort_ops)
    writer.linear("a", "x", outputs=["y"])
    inits = [helper.make_tensor(n, {np.uint8: TensorProto.UINT8, np.float32: TensorProto.FLOAT}[
        store.arrays[n].dtype.type], store.arrays[n].shape, store.arrays[n].tobytes(), raw=True)
        for n in writer.used]
    graph = helper.make_graph(writer.w.nodes, "linear",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["T", q.k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", q.n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid(DOMAIN, 1)],
                              functions=make_quantized_linear_functions() + [make_offsets_function()])
    return model


CASES = [("gguf", "Q4_0"), ("gguf", "Q4_1"), ("gguf", "Q8_0"), ("gguf", "Q4_K"), ("split", "Q8_0"), ("split", 8, 64, False),
         (4, 16, True), (4, 32, False), (4, 64, True), (4, 128, False), (8, 32, True), (8, 64, False)]


def case_weight(case, n=48):
    if case[0] in ("gguf", "split") and isinstance(case[1], str):
        k = 256 if case[1] == "Q4_K" else 128     # Q4_K's scales d x sc: float32 in the kernel's layout
        q = from_gguf(case[1], gguf_block(case[1], random_weight(n, k=k))[0], k)
    elif case[0] == "split":
        q = quantize_weight(random_weight(n, k=128), *case[1:])
    else:
        q = quantize_weight(random_weight(n, k=100), case[0], case[1], case[2])
    if case[0] == "split":
        split = split_8bit(q)
        assert (split.bits, split.repeats, split.kernel_k) == (4, 2, 2 * q.k)
        np.testing.assert_allclose(split.dequantize(), q.dequantize(), rtol=1e-6, atol=1e-6)
        q = split
    return q


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matmul_nbits_computes_the_dequantized_weight(case):
    """ONNX Runtime's kernel reads our packing as we mean it: y == x @ dequant(W)^T."""
    q = case_weight(case)
    x = np.random.default_rng(3).standard_normal((5, q.k)).astype(np.float32)
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    np.testing.assert_allclose(run_linear(q, x), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != 8 and c != ("gguf", "Q8_0")], ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 70])
def test_quantized_linear_kernel_computes_the_dequantized_weight(op_library, case, rows):
    """The ONNX Runtime graphs' 4-bit linear, one ``QuantizedLinear`` node: its C++ kernel
    (every build: batch-1 paths, up to 4 rows in one pass on AVX2 and with AVX-512 VNNI (which
    takes 5 as passes of 4 and 1), and tiled paths, 16-row
    groups with a partial last one where N is 37, K padded to whole blocks where it is 100)
    and its function body (MatMulNBits + AddBlockOffsets) against x @ dequant(W)^T in float64."""
    q = case_weight(case, n=37)
    x = np.random.default_rng(rows).standard_normal((rows, q.k)).astype(np.float32)
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    got, ran = run_linear(q, x, library=op_library)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    op = ("QuantizedLinearSplit8" if q.repeats == 2 else "QuantizedLinearWithOffsets" if q.offsets is not None
          else "QuantizedLinear")
    assert (op in ran) is (op_library is not None)
    assert ("MatMulNBits" in ran) is (op_library is None)


@pytest.mark.parametrize("case", [("gguf", "Q4_1"), ("split", "Q8_0"), (4, 32, False), (4, 16, True)],
                         ids=lambda c: "-".join(map(str, c)))
def test_quantized_linear_two_to_eight_rows_equal_each_row_alone_with_vnni(tmp_path_factory, case):
    """With AVX-512 VNNI (the native build), 2-8 rows of x run the batch-1 loop, up to 4 rows in
    one pass over the weights (not the float32 panels): each output row is bit-equal to that
    row's batch-1 output (N 37: a partial 16-row group; K 100: a padded block), and within 1e-5
    of float64."""
    from tests.conftest import build_kernel_library, cpu_flags
    if "avx512_vnni" not in cpu_flags():
        pytest.skip("the 2-8 row path is the AVX-512 VNNI build's")
    library = build_kernel_library("native", tmp_path_factory)
    q = case_weight(case, n=37)
    x = np.random.default_rng(11).standard_normal((8, q.k)).astype(np.float32)
    alone = np.concatenate([run_linear(q, x[i:i + 1], library=library)[0] for i in range(8)])
    for rows in range(2, 9):
        got, _ = run_linear(q, x[:rows], library=library)
        np.testing.assert_array_equal(got, alone[:rows])
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    np.testing.assert_allclose(alone, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("case", [(4, 32, False), ("split", 8, 32, False), ("split", 8, 32, True)],
                         ids=["int4", "split8", "split8-symmetric"])
def test_quantized_linear_batch1_streams_cover_every_group(op_library, case, rows):
    """Batch 1 (and the few rows that take its loop with VNNI: 3, and 6 as passes of 4 and 2)
    over a weight large enough to be shared by the threads (46 16-row groups, the last
    partial; > 64 KiB): each thread reads its contiguous range of groups as several interleaved
    streams (gemv_groups_vnni), parts of unequal length; every output row must still be
    x @ dequant(W)^T (float64). Symmetric int8 (zero point 128): every offset is 0, and the
    kernel's blocks store none, so a block's stride is shorter."""
    n, k = 16 * 45 + 7, 256
    w = random_weight(n, k=k)
    q = quantize_weight(w, *case[1:]) if case[0] == "split" else quantize_weight(w, *case)
    q = split_8bit(q) if case[0] == "split" else q
    x = np.random.default_rng(5).standard_normal((rows, q.k)).astype(np.float32)
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    got, _ = run_linear(q, x, library=op_library)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("case", [(4, 32, False), ("split", 8, 32, False)], ids=["int4", "split8"])
def test_quantized_linear_batch1_sessions_at_once_keep_their_own_x(kernel_library, case):
    """Each thread makes x's integer forms for its work items in buffers of its own, once a pass
    over the weights (own_x_step). Two sessions of two weights, each called from two Python
    threads at once for 1-6 rows (6: passes of 4 and 2) on x that changes every call, 60 calls
    each: every output equals that session's output for that x alone, bit for bit (a thread that
    kept another pass's planes, or another session's, would give another x's product)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(21)
    sessions, xs, alone = [], [], []
    for n, k in ((16 * 45 + 7, 256), (16 * 30, 384)):
        w = random_weight(n, k=k)
        q = quantize_weight(w, *case[1:]) if case[0] == "split" else quantize_weight(w, *case)
        q = split_8bit(q) if case[0] == "split" else q
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        so.register_custom_ops_library(kernel_library)
        sess = ort.InferenceSession(linear_model(q).SerializeToString(), so, providers=["CPUExecutionProvider"])
        x = [rng.standard_normal((1 + i % 6, q.k)).astype(np.float32) for i in range(12)]
        sessions.append(sess)
        xs.append(x)
        alone.append([sess.run(None, {"a": xi})[0] for xi in x])
    start = threading.Barrier(4)

    def calls(s: int, offset: int) -> int:
        start.wait()
        for i in range(60):
            j = (i + offset) % len(xs[s])
            np.testing.assert_array_equal(sessions[s].run(None, {"a": xs[s][j]})[0], alone[s][j])
        return 60

    with ThreadPoolExecutor(4) as pool:
        done = [pool.submit(calls, s, offset) for s in (0, 1) for offset in (0, 5)]
        assert sum(f.result() for f in done) == 240


@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_linear_batch1_common_part_with_outlier_weights(op_library, rows):
    """x with a large common part (1e3 + N(0, 1)) against 256-wide asymmetric blocks of small
    positive weights and one -3 outlier each (the block's midpoint, offset + 8 scale, far from
    its typical weight), power-of-two scales so the folded offsets are exact: within 10x
    float32's own error (numpy's x @ w^T), as the function body, the portable loops, the M > 4
    panel and the centered batch-1 loops are (~1e-7). The AVX2 batch-1 loops (M <= 4) do not
    center x: their block terms scale * sum_k x_k (q_k - 8) and (offset + 8 scale) * sum_k x_k
    cancel here, and each rounded to float32 they lost 1.5e-5 to 1.7e-5 (QA); they are combined
    in float64 now."""
    r = np.random.default_rng(0)
    w = np.abs(r.standard_normal((37, 512))).astype(np.float32) * 0.05
    w[:, np.arange(0, 512, 256) + r.integers(0, 256, 2)] = -3.0
    q = quantize_weight(w, 4, 256, False)
    q.scales[:] = 2.0 ** np.round(np.log2(q.scales))        # offset = -scale * zero point: exact
    x = (1e3 + np.random.default_rng(rows).standard_normal((rows, 512))).astype(np.float32)
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    float32_error = np.abs(x @ q.dequantize().T - expected).max() / np.abs(expected).max()
    got, _ = run_linear(q, x, library=op_library)
    assert np.abs(got - expected).max() / np.abs(expected).max() <= max(1e-6, 10 * float32_error)


@pytest.mark.parametrize("case", [(4, 128, False), ("split", 8, 128, False)], ids=["int4-asym", "split8"])
def test_quantized_linear_keeps_float32_accuracy_on_offset_inputs(op_library, case):
    """x with a large common part (mean 50): the batch-1 path centers x per block, so the
    block offsets' term does not cancel against the codes' (uncentered, 2e-5 to 7e-5 off)."""
    if case[0] == "split":
        q = split_8bit(quantize_weight(random_weight(40, k=4096), *case[1:]))
    else:
        q = quantize_weight(random_weight(40, k=4096), *case)
    x = (50 + np.random.default_rng(1).standard_normal((1, q.k))).astype(np.float32)
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    got, _ = run_linear(q, x, library=op_library)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 5e-6


@pytest.mark.parametrize("scale", [1e-36, 1e-30, 1.0, 1e30])
def test_quantized_linear_batch1_keeps_float32_accuracy_at_any_scale(op_library, scale):
    """The batch-1 path at tiny and huge x, with a block of x all zero and one holding a single
    value (the VNNI build writes x per block as 32-bit integers scaled by a power of two, which
    takes more than one float's exponent range at 1e-36): within float32's error of float64
    x @ dequant(W)^T."""
    q = quantize_weight(random_weight(37, k=256), 4, 32, False)
    x = np.random.default_rng(7).standard_normal((1, q.k)) * scale
    x[0, 32:96] = 0.0
    x[0, 70] = 3.0 * scale
    x = x.astype(np.float32)
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    got, _ = run_linear(q, x, library=op_library)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 5e-6


@pytest.mark.parametrize("scale", [1e-38, 1e-39, 1e-42])
@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_linear_near_float32_subnormals(op_library, scale, rows):
    """x at and below float32's smallest normal: within 4x float32's own error there (numpy's
    float32 x @ W^T), or 5e-6. The batch-1 loops center x per block; at such x the block mean
    is inexact, and a kernel that takes sum_k (x_k - mean) as 0 lost up to 1.1e-4 at 1e-39
    (QA). Every batch-1 loop now adds offset * sum_k (x_k - mean) (the AVX-512 ones since they
    first ran, on a Zen 5 VM)."""
    q = quantize_weight(random_weight(16, k=256, seed=1), 4, 128, False)
    x = (np.random.default_rng(0).standard_normal((rows, q.k)) * scale).astype(np.float32)
    w = q.dequantize()
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    float32_error = np.abs(x @ w.T - expected).max() / np.abs(expected).max()
    got, _ = run_linear(q, x, library=op_library)
    assert np.abs(got - expected).max() / np.abs(expected).max() <= max(5e-6, 4 * float32_error)


@pytest.mark.parametrize("case", [(4, 128, False), ("split", 8, 128, False)], ids=["int4-asym", "split8"])
def test_quantized_linear_batch1_one_value_among_zeros(op_library, case):
    """x zero but for one value in a 128-wide block: centered, the block is one large value and
    127 small ones. Written as 24-bit integers (the VNNI build's first form) the small ones lost
    ~1.5e-5 relative (found by QA); as 32-bit integers, and in the float32 loops, far less."""
    w = random_weight(64, k=256, seed=1)
    q = split_8bit(quantize_weight(w, *case[1:])) if case[0] == "split" else quantize_weight(w, *case)
    worst = 0.0
    for j in range(0, 256, 9):
        x = np.zeros((1, 256), np.float32)
        x[0, j] = 0.7316987
        expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
        got, _ = run_linear(q, x, library=op_library)
        worst = max(worst, np.abs(got - expected).max() / np.abs(expected).max())
    assert worst < 5e-6


def test_quantized_linear_batch1_block_sum_past_float32_range(op_library):
    """All-positive x of 3e36 in 128-wide blocks: their sum passes float32's range, their mean
    does not. The outputs are finite and right (the kernel's mean once came from the sum: NaN)."""
    q = quantize_weight(random_weight(16, k=256), 4, 128, False)
    x = (3e36 * (1 + 0.1 * np.random.default_rng(9).random((1, 256)))).astype(np.float32)
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    got, _ = run_linear(q, x, library=op_library)
    assert np.isfinite(got).all()
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5


@pytest.mark.parametrize("x_scale", [1.0, 1e-20])
@pytest.mark.parametrize("rows", [1, 3])
def test_quantized_linear_batch1_huge_weights_stay_finite(op_library, rows, x_scale):
    """Weights of ~1e30 (outputs ~1e31 at x ~ 1, far inside float32's range): finite and within
    float32's error. The AVX2 batch-1 loops combined a block's two terms at x's integer scale
    (C = x * 2^s, s ~ 28 at x ~ 1) before applying 2^-s, so weights past ~1e29 gave inf and NaN
    whatever x's size (QA)."""
    q = quantize_weight(random_weight(37, k=256) * np.float32(1e30), 4, 32, False)
    x = (np.random.default_rng(4).standard_normal((rows, q.k)) * x_scale).astype(np.float32)
    expected = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    got, _ = run_linear(q, x, library=op_library)
    assert np.isfinite(got).all()
    assert np.abs(got - expected).max() / np.abs(expected).max() < 5e-6


def test_quantized_linear_batch1_propagates_nan_and_inf(op_library):
    """A NaN or an infinity in x makes every output non-finite, as float32 arithmetic does (the
    kernel centers x per block, so an infinity becomes NaN)."""
    q = quantize_weight(random_weight(37, k=128), 4, 32, False)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.random.default_rng(8).standard_normal((1, q.k)).astype(np.float32)
        x[0, 40] = bad
        got, _ = run_linear(q, x, library=op_library)
        assert not np.isfinite(got).any(), bad


def one_node_session(node, types: dict, library: str) -> ort.InferenceSession:
    """A session of the one kernel-library ``node`` (inputs named and typed by ``types``,
    output ``y``), its functions' bodies attached."""
    from builder.fused_ops import make_quantized_linear_functions
    from builder.paged_attention import DOMAIN

    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in types.items()],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, functions=make_quantized_linear_functions(),
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1),
                                             helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_quantized_linear_rejects_mismatched_shapes(kernel_library):
    """A node whose tensors do not fit its attributes fails with the shapes named, also a weight
    that keeps its address with another shape; the node goes on with good tensors."""
    from builder.fused_ops import QUANTIZED_LINEAR_OP_TYPE
    from builder.paged_attention import DOMAIN

    q = quantize_weight(random_weight(37, k=64), 4, 32, True)
    node = helper.make_node(QUANTIZED_LINEAR_OP_TYPE, ["x", "qweight", "scales", "zero_points"], ["y"],
                            domain=DOMAIN, N=37, K=64, block_size=32)
    types = {"x": TensorProto.FLOAT, "qweight": TensorProto.UINT8, "scales": TensorProto.FLOAT,
             "zero_points": TensorProto.UINT8}
    sess = one_node_session(node, types, kernel_library)
    feed = {"x": np.ones((2, 64), np.float32), "qweight": q.qweight.reshape(37, 2, 16), "scales": q.scales,
            "zero_points": np.full(37, 0x88, np.uint8)}
    expected = feed["x"] @ q.dequantize().T
    np.testing.assert_allclose(sess.run(None, feed)[0], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"QuantizedLinear \(N 37, K 64, block_size 32\): x \[2, 48\]"):
        sess.run(None, dict(feed, x=np.ones((2, 48), np.float32)))
    with pytest.raises(Exception, match=r"zero_points \[36\]"):
        sess.run(None, dict(feed, zero_points=np.full(36, 0x88, np.uint8)))
    # a weight at the address it had, with another shape (a view of its first rows): checked,
    # not computed from the weights repacked before (QA, session 32)
    np.testing.assert_allclose(sess.run(None, feed)[0], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match=r"qweight \[36, 2, 16\]"):
        sess.run(None, dict(feed, qweight=feed["qweight"][:36]))
    np.testing.assert_allclose(sess.run(None, feed)[0], expected, rtol=1e-5, atol=1e-5)


def test_split8_node_reads_x_once_as_an_8bit_weight(kernel_library):
    """A ``QuantizedLinearSplit8`` node (the exporter's form of a split 8-bit weight, e.g.
    SmolLM2's Q8_0 lm_head) takes x once and gives its product with the 8-bit weight; a weight
    whose halves' scales are not 16:1, or an x of the halves' width, fails with the node named."""
    from builder.fused_ops import QUANTIZED_LINEAR_SPLIT8_OP_TYPE
    from builder.paged_attention import DOMAIN

    q8 = quantize_weight(random_weight(37, k=128), 8, 32, False)
    q = split_8bit(q8)
    node = helper.make_node(QUANTIZED_LINEAR_SPLIT8_OP_TYPE,
                            ["x", "qweight", "scales", "zero_points", "offsets", "block_sum_matrix"], ["y"],
                            domain=DOMAIN, N=37, K=256, block_size=32)
    types = {"x": TensorProto.FLOAT, "qweight": TensorProto.UINT8, "scales": TensorProto.FLOAT,
             "zero_points": TensorProto.UINT8, "offsets": TensorProto.FLOAT, "block_sum_matrix": TensorProto.FLOAT}
    sess = one_node_session(node, types, kernel_library)
    a = np.random.default_rng(3).standard_normal((2, 128)).astype(np.float32)
    feed = {"x": a, "qweight": q.qweight.reshape(37, 8, 16), "scales": q.scales,
            "zero_points": np.full(37 * 4, 0x88, np.uint8), "offsets": q.offsets,
            "block_sum_matrix": np.zeros((256, 4), np.float32)}
    expected = a.astype(np.float64) @ q8.dequantize().astype(np.float64).T
    np.testing.assert_allclose(sess.run(None, feed)[0], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    bad = q.scales.copy()
    bad[5, 1] *= 1.5
    sess = one_node_session(node, types, kernel_library)
    with pytest.raises(Exception, match=r"QuantizedLinearSplit8 \(N 37, K 256, block_size 32\): row 5, block 1"):
        sess.run(None, dict(feed, scales=bad))
    with pytest.raises(Exception, match=r"QuantizedLinearSplit8 .*x \[2, 256\] is not \[M, K / 2\]"):
        sess.run(None, dict(feed, x=np.concatenate([a, a], axis=1)))


def test_build_options_are_checked_before_the_model_is_loaded(tmp_path):
    """A bad option is reported at once: no model is read (an unknown model path would raise
    FileNotFoundError) and no output directory is written."""
    from builder.build import build_engine
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        build_engine(str(tmp_path / "no-such-model"), str(tmp_path / "engine"),
                     BuildConfig(max_num_seqs=64, max_num_batched_tokens=8))
    assert not (tmp_path / "engine").exists()


def test_build_options_are_validated():
    for bad, name in ((dict(quantization="int3"), "--quantization"),
                      (dict(quantization="int4", quant_block_size=24), "--quant-block-size"),
                      (dict(quantization="int4", accuracy_level=7), "--accuracy-level"),
                      (dict(quantization="w8a8", accuracy_level=4), "--accuracy-level 4: .* w8a8 always takes int8"),
                      (dict(quantization="none", accuracy_level=4), "--accuracy-level 4: .* an unquantized engine has none"),
                      (dict(quantize_lm_head=True), "--quantize-lm-head: --quantization none quantizes nothing"),
                      (dict(draft_layers=0), "--draft-layers must be >= 1, got 0"),   # built the whole model (QA)
                      (dict(quantization="w8a8", activation_planes=3), "--activation-planes must be 1 or 2, got 3"),
                      (dict(quantization="int4", activation_planes=1), "--activation-planes 1: only --quantization w8a8"),
                      (dict(quantization="w8a8", quant_block_size=64), "--quant-block-size / --quant-asymmetric: w8a8"),
                      (dict(quantization="w8a8", quant_symmetric=False), "--quant-block-size / --quant-asymmetric: w8a8"),
                      (dict(quantization="int4", rotate_activations=True), "--rotate-activations: only --quantization none or w8a8"),
                      (dict(backend="tensorrt", rotate_activations=True), "--rotate-activations: only .* onnxruntime backend"),
                      (dict(max_num_seqs=64, max_num_batched_tokens=32), r"--max-num-batched-tokens \(32\) must be >= --max-num-seqs \(64\)")):
        with pytest.raises(ValueError, match=name):
            BuildConfig(**bad).validate(4096)


# -- tiny engines quantized from float weights, against HF on the dequantized weights ------

def dequantized_hf(hf, hf_dir, quantization, block_size, symmetric):
    """A copy of ``hf`` whose linear weights are the quantized ones, dequantized."""
    import copy

    loaded = load_model(hf_dir)
    quantized = quantize_model(loaded, quantization, block_size, symmetric)
    model = copy.deepcopy(hf)
    set_linear_weights(model, quantized, loaded.config, np.float32)
    return model.eval()


def three_prompts_logits(engine: str):
    """``(llm, prompts, logits)``: an ``LLM`` over ``engine``, three random prompts (1, 9 and
    30 tokens) and their last positions' logits ``[3, vocab]`` float32 from one prefill step."""
    llm = LLM(engine, num_kv_blocks=64, verify_checksums=False, num_threads=1)
    prompts = [np.random.default_rng(n).integers(0, 256, n).tolist() for n in (1, 9, 30)]
    seqs = [ScheduledSeq(p, list(range(8 * i, 8 * i + 8)), 0, len(p)) for i, p in enumerate(prompts)]
    return llm, prompts, llm.engine.runner.execute(StepBatch(prefill=seqs))


def set_linear_weights(model, quantized, config, dtype, pre_hook=None):
    """Put each layer's quantized linear weights, dequantized to ``dtype``, into the HF
    ``model`` (the fused qkv and gate_up split back), with ``pre_hook`` on each linear."""
    c = config
    if c.family == "gpt2":   # Conv1D modules hold W^T; q/k/v are one c_attn, as our qkv
        for i, block in enumerate(model.transformer.h):
            for module, name in ((block.attn.c_attn, "qkv"), (block.attn.c_proj, "o"),
                                 (block.mlp.c_fc, "up"), (block.mlp.c_proj, "down")):
                value = quantized[f"layers.{i}.{name}.weight"].dequantize().T
                module.weight.data = torch.from_numpy(np.ascontiguousarray(value).astype(dtype))
                if pre_hook:
                    module.register_forward_pre_hook(pre_hook)
        return
    for i, layer in enumerate(model.model.layers):
        qkv = quantized[f"layers.{i}.qkv.weight"].dequantize()
        q, k, v = np.split(qkv, [c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim])
        gate, up = np.split(quantized[f"layers.{i}.gate_up.weight"].dequantize(), 2)
        for param, value in ((layer.self_attn.q_proj, q), (layer.self_attn.k_proj, k),
                             (layer.self_attn.v_proj, v), (layer.mlp.gate_proj, gate), (layer.mlp.up_proj, up),
                             (layer.self_attn.o_proj, quantized[f"layers.{i}.o.weight"].dequantize()),
                             (layer.mlp.down_proj, quantized[f"layers.{i}.down.weight"].dequantize())):
            param.weight.data = torch.from_numpy(value.astype(dtype))
            if pre_hook:
                param.register_forward_pre_hook(pre_hook)


@pytest.mark.parametrize("kind,quantization,block_size,symmetric", [
    ("llama-gqa", "int4", 32, True), ("llama-gqa", "int8", 64, False), ("qwen2-bias", "int4", 16, False)])
def test_tiny_quantized_engine_matches_hf_on_dequantized_weights(tiny_model, tmp_path, kind, quantization,
                                                                 block_size, symmetric):
    hf, float_engine = tiny_model(kind)
    hf_dir = float_engine.replace("engine", "hf")
    engine = build(hf_dir, str(tmp_path / "engine"), max_seq_len=256, max_num_batched_tokens=256,
                   max_num_seqs=16, block_size=4, quantization=quantization, quant_block_size=block_size,
                   quant_symmetric=symmetric, accuracy_level=0)   # float32 activations: exact
    reference = dequantized_hf(hf, hf_dir, quantization, block_size, symmetric)
    # the kernels' graphs: a Llama layer over 4-bit (or split 8-bit) linears is one DecoderLayer
    # node; a QKV bias (Qwen2), or linears of two kinds (int8 splits a weight only where K is a
    # multiple of twice the block: at block 64 the tiny model's others stay MatMulNBits) keep
    # the layer's own nodes
    fused = decoder_layer_nodes(engine)
    assert fused == (hf.config.num_hidden_layers if (kind, quantization) == ("llama-gqa", "int4") else 0)
    llm, prompts, logits = three_prompts_logits(engine)
    for row, p in zip(logits, prompts):
        with torch.no_grad():
            ref = reference(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(row, ref, atol=1e-4, rtol=1e-4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=8, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref


def write_k_quant_gguf(path, kinds):
    """A tiny random Llama GGUF (hidden 256, 2 layers, vocab 256) whose linears are stored as
    llama.cpp's Q4_K_M stores them: ``kinds[0]`` for attn_q/k/output and ffn_gate/up,
    ``kinds[1]`` for attn_v, ffn_down and the (tied) token embedding."""
    from gguf import GGUFWriter

    hidden, inter, vocab = 256, 512, 256
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_vocab_size(vocab)
    w.add_layer_norm_rms_eps(1e-5)
    seed = iter(range(100))

    def add(name, n, k, kind):
        raw = random_k_quant(kind, n, k, seed=next(seed))
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", vocab, hidden, kinds[1])
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(2):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        for name, n, k, kind in (("attn_q", hidden, hidden, 0), ("attn_k", 128, hidden, 0), ("attn_v", 128, hidden, 1),
                                 ("attn_output", hidden, hidden, 0), ("ffn_gate", inter, hidden, 0),
                                 ("ffn_up", inter, hidden, 0), ("ffn_down", hidden, inter, 1)):
            add(p + name + ".weight", n, k, kinds[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.filterwarnings("ignore:.*has no tokenizer")
def test_k_quant_gguf_builds_exactly(tmp_path):
    """llama.cpp's k-quants (QA: untested): a Q4_K/Q6_K GGUF's float engine computes what HF
    transformers computes from the same file; int4 maps Q4_K blocks exactly (logits of the fp32
    engine of a Q4_K file) and, in a Q4_K_M-style file, keeps the Q6_K weights at 8 bits."""
    from transformers import AutoModelForCausalLM

    mixed = write_k_quant_gguf(tmp_path / "q4_k_m.gguf", ("Q4_K", "Q6_K"))
    q4_k = write_k_quant_gguf(tmp_path / "q4_k.gguf", ("Q4_K", "Q4_K"))
    limits = dict(max_seq_len=128, max_num_batched_tokens=128, max_num_seqs=4, block_size=8)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q4_k_m.gguf", dtype=torch.float32).eval()
    _, prompts, logits = three_prompts_logits(build(mixed, str(tmp_path / "fp32"), **limits))
    for row, p in zip(logits, prompts):
        with torch.no_grad():
            np.testing.assert_allclose(row, hf(torch.tensor([p])).logits[0, -1].numpy(), rtol=1e-4, atol=1e-4)

    int4 = build(mixed, str(tmp_path / "int4"), quantization="int4", **limits)
    with open(os.path.join(int4, "engine.json")) as f:
        sources = json.load(f)["quantization"]["weights"]
    assert sources["layers.0.gate_up.weight"] == "gguf:Q4_K"
    assert sources["layers.0.down.weight"] == "float+split"       # Q6_K: 8 bits (split for the kernel)
    assert sources["layers.0.qkv.weight"] == "float+split"        # Q4_K q/k beside a Q6_K v: 8 bits
    assert sources["embed.weight"] == "float+split"               # a Q6_K lm_head: 8 bits, not float32

    exact_int4 = build(q4_k, str(tmp_path / "q4_k-int4"), quantization="int4", **limits)
    with open(os.path.join(exact_int4, "engine.json")) as f:
        assert set(json.load(f)["quantization"]["weights"].values()) == {"gguf:Q4_K"}
    llm4, prompts, exact = three_prompts_logits(exact_int4)
    llm, _, reference = three_prompts_logits(build(q4_k, str(tmp_path / "q4_k-fp32"), **limits))
    np.testing.assert_allclose(exact, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm4.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]


def decoder_layer_nodes(engine: str, kind: str = "decode") -> int:
    """DecoderLayer nodes in ``engine``'s ``{kind}.kernels.onnx``."""
    import onnx

    graph = onnx.load(os.path.join(engine, f"{kind}.kernels.onnx"), load_external_data=False).graph
    return sum(n.op_type == "DecoderLayer" for n in graph.node)


@pytest.mark.parametrize("kind, quantization, kv_cache_dtype", [
    ("llama-gqa", "int4", "float32"), ("llama-gqa", "int4", "float16"), ("llama-gqa", "int8", "float32"),
    ("llama-wide", "int4", "float32")])
def test_fused_decoder_layers_compute_what_their_nodes_compute(tiny_model, tmp_path, kind, quantization,
                                                              kv_cache_dtype):
    """An int4 (or int8: split 8-bit linears) engine's kernels graphs hold one DecoderLayer node per layer
    (builder.fused_ops.fuse_decoder_layers, trtllm_lite/ort_kernels/decoder_layer.cc): prompts
    in chunks, steps mixing prompt chunks with decodes, and decodes give the tokens and
    logprobs of the same engine with each layer's ten nodes, bit for bit (a float16 pool rounds
    the K/V, so any difference in the norms' arithmetic would show as ~1e-3 in the logprobs:
    QA, session 33). ``llama-wide``: linears and contexts large enough that the parts split
    their work over the threads, which decode steps hand out through the layer's WorkRegion
    (kernel_common.h) and the ten nodes through ONNX Runtime."""
    import shutil

    import onnx

    from builder.paged_attention import with_kv_write_in_op, without_attention_metadata
    from trtllm_lite import ort_kernels

    if ort_kernels.library_path() is None:
        pytest.skip("the DecoderLayer op is trtllm-lite's kernels' (no C++ compiler here)")
    hf, engine = tiny_model(kind, quantization=quantization, quant_block_size=32, quant_symmetric=False,
                            accuracy_level=0, kv_cache_dtype=kv_cache_dtype)
    unfused = str(tmp_path / "unfused")
    shutil.copytree(engine, unfused)
    for kind in ("prefill", "decode"):
        assert decoder_layer_nodes(engine, kind) == hf.config.num_hidden_layers
        graph = onnx.load(os.path.join(engine, f"{kind}.onnx"), load_external_data=False)
        onnx.save(with_kv_write_in_op(without_attention_metadata(graph)), os.path.join(unfused, f"{kind}.kernels.onnx"))
        assert decoder_layer_nodes(unfused, kind) == 0
    lengths = (1, 9, 30, 5) if kind != "llama-wide" else (1, 100, 150, 5)   # (wide: 64 KiB of K/V and more)
    prompts = [np.random.default_rng(n).integers(0, 256, n).tolist() for n in lengths]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    # an 8-token budget: chunked prompts beside decodes; 48: steps of up to 45 rows, whose norms
    # run 8 rows side by side and split over the threads (elementwise.cc skip_norm)
    for budget in (8, 48):
        results = []
        for path in (engine, unfused):
            llm = LLM(path, num_kv_blocks=64, verify_checksums=False, max_num_batched_tokens=budget, max_num_seqs=4)
            results.append(llm.generate(prompts, params))
        for fused_out, plain_out in zip(*results):
            a, b = fused_out.outputs[0], plain_out.outputs[0]
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs, b.logprobs):
                assert {t: v.logprob for t, v in la.items()} == {t: v.logprob for t, v in lb.items()}


def test_fused_decoder_layer_error_at_a_decode_step_leaves_the_next_step_whole(tiny_model):
    """A decode step (the layer's WorkRegion) whose attention part refuses its input (a block
    outside the pool) fails with the kernel's message, and the next steps on the same sessions
    give what they give without it: the region's threads were let go."""
    from trtllm_lite import ort_kernels

    if ort_kernels.library_path() is None:
        pytest.skip("the DecoderLayer op is trtllm-lite's kernels' (no C++ compiler here)")
    _, engine = tiny_model("llama-wide", quantization="int4", quant_block_size=32, quant_symmetric=False,
                           accuracy_level=0)
    llm = LLM(engine, num_kv_blocks=32, verify_checksums=False, enable_prefix_caching=False)
    runner = llm.engine.runner
    prompt = np.random.default_rng(0).integers(0, 256, 100).tolist()
    blocks = list(range(-(-(len(prompt) + 1) // llm.engine.block_size)))
    runner.execute(StepBatch(prefill=[ScheduledSeq(prompt, blocks, 0, len(prompt))]))
    decode = ScheduledSeq(prompt + [1], blocks, len(prompt), 1)
    expected = runner.execute(StepBatch(decode=[decode]))
    bad = ScheduledSeq(prompt + [1], [10_000] + blocks[1:], len(prompt), 1)
    for _ in range(3):
        with pytest.raises(Exception, match=r"block_tables\[0, 0\] = 10000 outside the pool"):
            runner.execute(StepBatch(decode=[bad]))
        np.testing.assert_array_equal(runner.execute(StepBatch(decode=[decode])), expected)


# -- W8A8: int8 weights per channel, int8 activations per token ---------------------------

def test_w8a8_weight_codes_within_half_a_step():
    """Per output channel: the largest weight maps to +-127 exactly, every weight within half
    a step of its code; an all-zero row keeps scale 1 and codes 0."""
    w = random_weight(40, 72, seed=3) * np.linspace(0.01, 10, 40, dtype=np.float32)[:, None]
    w[5] = 0.0
    q = quantize_w8a8(w)
    assert q.weight.shape == (72, 40) and q.weight.dtype == np.int8 and q.scales.shape == (40,)
    assert np.abs(q.weight).max(axis=0)[[i for i in range(40) if i != 5]].min() == 127
    assert q.scales[5] == 1.0 and not q.weight[:, 5].any()
    err = np.abs(q.dequantize() - w)
    assert (err <= 0.5 * q.scales[:, None] * (1 + 1e-6)).all()


def w8a8_reference_logits(hf, hf_dir, prompt, quantize_lm_head=False, planes=2, rotate=False):
    """HF on the w8a8 weights dequantized, with every linear's input rounded per token as the
    engine rounds it (QuantizeRows), in float64: the engine's arithmetic up to float32 rounding.
    ``rotate``: on the rotated weights (builder.rotation: norms of ones, the embedding and
    lm_head untied), each down projection's input times the block Hadamard matrix first."""
    import copy

    from .test_fused_ops import quantize_rows_reference

    loaded = load_model(hf_dir)
    model = copy.deepcopy(hf).double()
    if rotate:
        loaded = rotate_activations(loaded)
        h = torch.from_numpy(loaded.weights[DOWN_ROTATION].astype(np.float64))
        inner = model.model
        inner.embed_tokens.weight = torch.nn.Parameter(torch.from_numpy(loaded.weights["embed.weight"].astype(np.float64)))
        model.lm_head.weight = torch.nn.Parameter(torch.from_numpy(loaded.weights["lm_head.weight"].astype(np.float64)))
        for norm in [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.data.fill_(1.0)
        for i, layer in enumerate(inner.layers):
            if f"layers.{i}.gate_up.bias" in loaded.weights:
                gate_b, up_b = np.split(loaded.weights[f"layers.{i}.gate_up.bias"].astype(np.float64), 2)
                layer.mlp.up_proj.bias.data = torch.from_numpy(up_b)
            for name, module in (("o", layer.self_attn.o_proj), ("down", layer.mlp.down_proj)):
                if f"layers.{i}.{name}.bias" in loaded.weights:
                    module.bias.data = torch.from_numpy(loaded.weights[f"layers.{i}.{name}.bias"].astype(np.float64))
            b = h.shape[0]
            layer.mlp.down_proj.register_forward_pre_hook(
                lambda module, args: ((args[0].reshape(*args[0].shape[:-1], -1, b) @ h).reshape(args[0].shape),))
    quantized = quantize_model(loaded, "w8a8", quantize_lm_head=quantize_lm_head, activation_planes=planes)
    c = loaded.config

    def round_rows(module, args):
        x = args[0].float().numpy()[0]
        q, scale = quantize_rows_reference(x, planes)
        rounded = ((q.astype(np.float64) - 128) * scale).reshape(planes, *x.shape).sum(axis=0)
        return (torch.from_numpy(rounded)[None],)

    set_linear_weights(model, quantized, c, np.float64, round_rows)
    if quantize_lm_head:   # (untied: the embedding keeps its float table, as the engine's Gather does)
        head = quantized["embed.weight" if c.tie_word_embeddings else "lm_head.weight"].dequantize()
        model.lm_head.weight = torch.nn.Parameter(torch.from_numpy(head.astype(np.float64)))
        model.lm_head.register_forward_pre_hook(round_rows)
    with torch.no_grad():
        return model.eval()(torch.tensor([prompt])).logits[0, -1].numpy()


@pytest.mark.parametrize("kind,quantize_lm_head,planes,rotate", [
    ("llama-gqa", None, 2, None), ("qwen2-bias", None, 2, None), ("llama-gqa", True, 1, None),
    ("qwen2-bias", None, 1, None), ("llama-mqa", True, 2, None), ("llama-hd12", None, 1, False),
    ("llama-gqa", None, 2, False), ("gpt2", None, 2, None),
    ("gpt2", None, 1, None)])
def test_tiny_w8a8_engine_matches_its_arithmetic_and_is_batch_invariant(tiny_model, tmp_path, kind,
                                                                        quantize_lm_head, planes, rotate):
    """The w8a8 engine's logits against HF computing the same arithmetic (weights dequantized,
    linear inputs rounded per token), biases included (qwen2; GPT-2 on every linear, its
    weights transposed in Conv1D modules), rotated activations (the Llama family's default;
    the tied lm_head then untied) and not; a prompt's logits and greedy
    tokens the same alone and batched with others (per-token scales: no token's rounding
    depends on another's); the tied lm_head stays float32 unless asked."""
    hf, float_engine = tiny_model(kind)
    hf_dir = float_engine.replace("engine", "hf")
    engine = build(hf_dir, str(tmp_path / "engine"), max_seq_len=256, max_num_batched_tokens=256,
                   max_num_seqs=16, block_size=4, quantization="w8a8", quantize_lm_head=quantize_lm_head,
                   activation_planes=planes, rotate_activations=rotate)
    rotated = kind != "gpt2" if rotate is None else rotate   # (the default: the Llama family's w8a8)
    import contextlib
    import io

    from trtllm_lite.cli import main
    from trtllm_lite.engine_dir import load_engine_dir

    manifest = load_engine_dir(engine).manifest
    assert manifest["quantization"]["method"] == "w8a8" and manifest["graph_variants"]["accuracy_level"] == {}
    assert manifest["build"]["rotate_activations"] is rotated
    assert (DOWN_ROTATION in manifest["weights"]["tensors"]) is rotated
    head_tensors = [n for n in manifest["weights"]["tensors"] if n.startswith(("embed.weight.", "lm_head.weight."))]
    assert bool(head_tensors) is bool(quantize_lm_head)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", "--engine", engine]) == 0
    assert (f"quantized   w8a8 (int8 weights per output channel, activations as {planes} int8 "
            f"plane{'s' if planes > 1 else ''} per token), lm_head {'int8' if quantize_lm_head else 'float'}"
            ) in out.getvalue()
    assert ("rotation    activations rotated" in out.getvalue()) is rotated
    llm, prompts, batched = three_prompts_logits(engine)
    for row, p in zip(batched, prompts):
        ref = w8a8_reference_logits(hf, hf_dir, p, bool(quantize_lm_head), planes, rotated)
        np.testing.assert_allclose(row, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)
    alone = llm.engine.runner.execute(StepBatch(prefill=[ScheduledSeq(prompts[2], list(range(8)), 0, 30)]))
    np.testing.assert_array_equal(alone[0], batched[2])
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert together == [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("prepacking,custom_kernels", [(True, True), (False, True), (True, False)])
def test_w8a8_uint8_weights_give_the_int8_weights_logits(tiny_model, monkeypatch, prepacking, custom_kernels):
    """The integer GEMMs on uint8 weights (w + 128, zero point 128) compute the products that
    int8 weights do: where this CPU's uint8 x int8 GEMM is exact (VNNI, AMX) the logits are
    the same to the bit; where it saturates (AVX2: the probe says so) the int8 sessions'
    logits are wrong and the uint8 ones are HF's on the same arithmetic, which the runner
    picks by default there. The uint8 arrays made for the sessions are zeroed once the
    runner exists: ONNX Runtime holds its own copies (the runner keeps none)."""
    from trtllm_lite.runners import w8a8_uint8
    from trtllm_lite.runners.onnxruntime_runner import OnnxRuntimeRunner, OrtOptions, uses_uint8_weights
    from trtllm_lite.runners.w8a8_uint8 import uint8_int8_gemm_saturates
    from trtllm_lite.engine_dir import load_engine_dir

    made = []
    rewrite = w8a8_uint8.uint8_weight_graph

    def recording(*args, **kwargs):   # the real rewrite; its arrays kept to be zeroed
        model, weights = rewrite(*args, **kwargs)
        made.extend(weights.values())
        return model, weights

    monkeypatch.setattr(w8a8_uint8, "uint8_weight_graph", recording)
    hf, float_engine = tiny_model("llama-gqa")
    _, engine = tiny_model("llama-gqa", quantization="w8a8")
    prompts = [np.random.default_rng(n).integers(0, 256, n).tolist() for n in (1, 9, 30)]
    seqs = [ScheduledSeq(p, list(range(8 * i, 8 * i + 8)), 0, len(p)) for i, p in enumerate(prompts)]
    logits = {}
    for unsigned in (True, False):
        options = OrtOptions(enable_prepacking=prepacking, custom_kernels=custom_kernels, w8a8_uint8_weights=unsigned)
        runner = OnnxRuntimeRunner(load_engine_dir(engine), 64, 1, options)
        assert bool(made) is unsigned
        for w in made:
            w[...] = 0
        made.clear()
        logits[unsigned] = runner.execute(StepBatch(prefill=seqs))
    saturates = uint8_int8_gemm_saturates()
    assert uses_uint8_weights(load_engine_dir(engine), OrtOptions()) is saturates
    import contextlib
    import io

    from trtllm_lite.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", "--engine", engine]) == 0
    assert ("int8 weights loaded as uint8 + 128" in out.getvalue()) is saturates
    assert not uses_uint8_weights(load_engine_dir(float_engine), OrtOptions(w8a8_uint8_weights=True))
    if not saturates:
        np.testing.assert_array_equal(logits[True], logits[False])
        return
    hf_dir = float_engine.replace("engine", "hf")
    for row, p in zip(logits[True], prompts):
        ref = w8a8_reference_logits(hf, hf_dir, p, False, 2, True)
        np.testing.assert_allclose(row, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)
    assert np.abs(logits[False] - logits[True]).max() > 1e-2   # what the saturation did


@pytest.mark.parametrize("kind", ["llama-mqa", "qwen2-bias", "llama-hd12"])
def test_rotated_float_engine_computes_the_same_function(tiny_model, kind):
    """--rotate-activations without quantization: the rotations are orthogonal and folded into
    the weights (or undone by them), so the engine's logits are HF's on the original weights,
    within float32 rounding; tied (llama-mqa: untied by the rotation), biased (qwen2: q/k/v
    biases stay), a hidden size that is not a power of two (llama-hd12: 48 = 3 x 16, the
    Kronecker rotation)."""
    hf, engine = tiny_model(kind, rotate_activations=True)
    from trtllm_lite.engine_dir import load_engine_dir

    manifest = load_engine_dir(engine).manifest
    assert manifest["build"]["rotate_activations"] is True and DOWN_ROTATION in manifest["weights"]["tensors"]
    assert manifest["model"]["tie_word_embeddings"] is False
    import contextlib
    import io

    from trtllm_lite.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", "--engine", engine]) == 0
    assert "rotation    activations rotated" in out.getvalue()
    llm, prompts, logits = three_prompts_logits(engine)
    for row, p in zip(logits, prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].numpy()
        np.testing.assert_allclose(row, ref, atol=1e-4, rtol=1e-4)


def test_rotation_brings_one_plane_closer_to_float_when_a_channel_is_an_outlier(tmp_path):
    """A tiny Llama whose residual stream carries one channel 40x the others (as trained
    LLMs' do, "massive activations"): with one activation plane, the rotated engine's logits lie closer to the float
    engine's than the unrotated engine's, on average over eight prompts (the point of the
    rotation)."""
    import transformers

    from .conftest import make_tiny_hf

    hf_dir = make_tiny_hf("llama-gqa", str(tmp_path / "hf"), seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():   # (the residual stream carries it from the embedding on)
        model.model.embed_tokens.weight[:, 5] *= 40.0
    model.save_pretrained(hf_dir, safe_serialization=True)
    options = dict(max_seq_len=128, max_num_batched_tokens=128, max_num_seqs=8, block_size=4)
    engines = {name: LLM(build(hf_dir, str(tmp_path / name), **options, **extra), num_kv_blocks=64,
                         verify_checksums=False, num_threads=1)
               for name, extra in (("float", {}),
                                   ("plain", dict(quantization="w8a8", activation_planes=1, rotate_activations=False)),
                                   ("rotated", dict(quantization="w8a8", activation_planes=1)))}
    prompts = [np.random.default_rng(n).integers(0, 256, 24).tolist() for n in range(8)]
    seqs = [ScheduledSeq(p, list(range(8 * i, 8 * i + 8)), 0, len(p)) for i, p in enumerate(prompts)]
    logits = {name: llm.engine.runner.execute(StepBatch(prefill=seqs)) for name, llm in engines.items()}
    ref = logits["float"]
    deviation = {k: np.abs(logits[k] - ref).max(axis=1) / np.ptp(ref, axis=1) for k in ("plain", "rotated")}
    # (measured: 0.56x on average here)
    assert deviation["rotated"].mean() < 0.8 * deviation["plain"].mean(), deviation


def test_rotation_takes_only_the_llama_family(tiny_model):
    hf, engine = tiny_model("gpt2")
    with pytest.raises(ValueError, match="--rotate-activations: GPT2LMHeadModel is not of the Llama family"):
        build(engine.replace("engine", "hf"), engine + "-rotated", quantization="w8a8", rotate_activations=True)


def test_rebuild_into_the_same_directory_leaves_no_file_of_the_old_build(tmp_path):
    """An int4 engine (with its accuracy-level graph variants) rebuilt in place as float32: the
    old build's files are gone, the user's own file stays (even where an older manifest listed
    it) and is not listed, and the engine loads with its checksums verified."""
    from builder.build import build_engine
    from trtllm_lite.engine_dir import load_engine_dir

    from .conftest import make_tiny_hf

    hf_dir = make_tiny_hf("llama-gqa", str(tmp_path / "hf"))
    out = str(tmp_path / "engine")
    options = dict(max_seq_len=64, max_num_batched_tokens=64, max_num_seqs=4, block_size=4)
    build_engine(hf_dir, out, BuildConfig(quantization="int4", **options))
    assert "decode.acc4.onnx" in os.listdir(out)
    with open(os.path.join(out, "NOTES.txt"), "w") as f:
        f.write("kept")
    with open(os.path.join(out, "engine.json")) as f:   # as builds before session 30 listed every file
        manifest = json.load(f)
    manifest["files"]["NOTES.txt"] = "0" * 64
    with open(os.path.join(out, "engine.json"), "w") as f:
        json.dump(manifest, f)
    build_engine(hf_dir, out, BuildConfig(**options))
    engine = load_engine_dir(out, verify_checksums=True)
    assert not [n for n in os.listdir(out) if ".acc" in n]
    assert set(os.listdir(out)) == set(engine.manifest["files"]) | {"engine.json", "NOTES.txt"}
    assert engine.manifest["quantization"]["method"] == "none"


# -- SmolLM2 int4 straight from the GGUF's Q4_1 blocks, against the fp32 engine -----------

@pytest.fixture(scope="module")
def smollm2_int4_engine(tmp_path_factory):
    return build(SMOLLM2, str(tmp_path_factory.mktemp("engines") / "smollm2-int4"), max_seq_len=1024,
                 max_num_batched_tokens=1024, max_num_seqs=32, quantization="int4")


@pytest.mark.slow
def test_smollm2_int4_maps_every_q4_1_block(smollm2_int4_engine):
    from trtllm_lite.engine_dir import load_engine_dir

    m = load_engine_dir(smollm2_int4_engine).manifest
    weights = dict(m["quantization"]["weights"])
    # the tied lm_head is Q8_0 in the GGUF: mapped exactly (by default), as two 4-bit halves
    assert weights.pop("embed.weight") == "gguf:Q8_0+split" and m["build"]["quantize_lm_head"] is True
    assert set(weights.values()) == {"gguf:Q4_1"}
    assert len(weights) == 120   # 210 Q4_1 tensors, q/k/v and gate/up fused
    assert m["build"]["quantization"] == "int4" and m["build"]["accuracy_level"] == 0
    import contextlib
    import io

    from trtllm_lite.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", "--engine", smollm2_int4_engine]) == 0
    assert ("quantized   int4 (block 32, from gguf:Q4_1, gguf:Q8_0+split), lm_head quantized, "
            "accuracy levels 0, 4 (built 0)") in out.getvalue()
    assert ("graphs      prefill, decode (+ prefill.kernels.onnx, decode.kernels.onnx for the C++ kernels; "
            "prefill.acc4.onnx, decode.acc4.onnx for accuracy level 4)") in out.getvalue()
    linear_bytes = sum(t["nbytes"] for n, t in m["weights"]["tensors"].items() if n.startswith("layers."))
    assert linear_bytes < 0.22 * 4 * 106e6          # ~6.6 bits per weight (codes, d, m, zero points)
    # the kernels' graphs: one DecoderLayer node per layer (the lm_head's linear stays its own)
    assert decoder_layer_nodes(smollm2_int4_engine) == 30


def test_load_runs_the_graphs_once_and_leaves_no_trace(smollm2_int4_engine, monkeypatch):
    """The runner calls each session once at load (the kernels repack their weights at their
    first call, which was the first request's TTFT: 700-900 ms for SmolLM2 int4, QA session
    33), on a dummy sequence whose K/V it then clears: each session ran exactly once before any
    request, the pool is all zeros, no step or graph time is counted, and generation is as
    without it (the other tests)."""
    runs = []
    run = ort.InferenceSession.run_with_iobinding

    def counted(session, *args, **kwargs):   # the real call, counted
        runs.append(id(session))
        return run(session, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", counted)
    llm = LLM(smollm2_int4_engine, num_kv_blocks=16, verify_checksums=False)
    runner = llm.engine.runner
    assert sorted(runs) == sorted(id(s) for s in runner.sessions.values())
    assert not runner.key_cache.any() and not runner.value_cache.any()
    assert runner.graph_time_s == 0 and llm.engine.num_steps == 0


def test_generate_stats_print_ttft_and_decode_speed(smollm2_int4_engine):
    """``trtllm-lite generate --stats`` prints what its help says: TTFT, end-to-end time and
    the decode speed (QA, session 33: the speed was missing)."""
    import contextlib
    import io
    import re

    from trtllm_lite.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["generate", "--engine", smollm2_int4_engine, "--prompt", "The capital of France is",
                     "--max-tokens", "8", "--temperature", "0", "--stats"]) == 0
    assert "Paris" in out.getvalue()
    stats = re.search(r"\[ttft (\d+) ms, e2e (\d+) ms, decode ([\d.]+) tokens/s, finish (\w+), steps (\d+)\]",
                      err.getvalue())
    assert stats, err.getvalue()
    assert int(stats[1]) <= int(stats[2]) and float(stats[3]) > 0


@pytest.mark.slow
def test_smollm2_int4_matches_fp32_engine(smollm2_int4_engine, smollm2_engine):
    int4 = LLM(smollm2_int4_engine, num_kv_blocks=256, verify_checksums=False, enable_prefix_caching=False)
    fp32 = LLM(smollm2_engine, num_kv_blocks=256, verify_checksums=False, enable_prefix_caching=False)
    tok = fp32.tokenizer
    prompt = tok.encode("The history of the Roman Empire begins with the founding of the city")
    seq = ScheduledSeq(prompt, list(range(4)), 0, len(prompt), num_logits=len(prompt))
    a = int4.engine.runner.execute(StepBatch(prefill=[seq]))
    b = fp32.engine.runner.execute(StepBatch(prefill=[ScheduledSeq(prompt, list(range(4)), 0, len(prompt),
                                                                    num_logits=len(prompt))]))
    rel = np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)
    assert rel.max() < 1e-3
    chat = tok.encode(tok.apply_chat_template(CAPITAL), add_special_tokens=False)
    prompts = [chat] + [tok.encode(p) for p in ("The history of the Roman Empire", "def fibonacci(n):",
                                                 "Water boils at")]
    got = [o.outputs[0].token_ids for o in int4.generate(prompts, GREEDY)]
    assert got == [o.outputs[0].token_ids for o in fp32.generate(prompts, GREEDY)]
    answer = int4.chat(CAPITAL, SamplingParams(max_tokens=32, temperature=0))[0].outputs[0].text
    assert "Paris" in answer


@pytest.mark.slow
def test_accuracy_level_picks_a_built_variant(smollm2_int4_engine, smollm2_engine):
    from trtllm_lite.engine_dir import load_engine_dir
    from trtllm_lite.runners.onnxruntime_runner import graph_files

    assert graph_files(load_engine_dir(smollm2_int4_engine, verify_checksums=False), 4) == {
        "prefill": "prefill.acc4.onnx", "decode": "decode.acc4.onnx"}
    # level 0: one QuantizedLinear node per linear (its kernel computes at float32); the level-4
    # variant has MatMulNBits (int8 activations) + AddBlockOffsets in their place
    import collections

    import onnx
    # (the Q8_0 lm_head: QuantizedLinearSplit8 over x once, no Concat)
    for file, want in (("prefill.onnx", {"QuantizedLinearWithOffsets": 120, "QuantizedLinearSplit8": 1}),
                       ("prefill.acc4.onnx", {"MatMulNBits": 121, "AddBlockOffsets": 121, "Concat": 1})):
        graph = onnx.load(os.path.join(smollm2_int4_engine, file), load_external_data=False).graph
        ops = collections.Counter(n.op_type for n in graph.node if n.op_type != "Concat" or "split8" in n.name)
        kinds = ("QuantizedLinearWithOffsets", "QuantizedLinearSplit8", "MatMulNBits", "AddBlockOffsets", "Concat")
        assert {op: ops[op] for op in kinds} == {**dict.fromkeys(kinds, 0), **want}
    with pytest.raises(ValueError, match="accuracy_level 4.*not quantized"):
        graph_files(load_engine_dir(smollm2_engine, verify_checksums=False), 4)
