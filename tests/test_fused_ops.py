"""RotarySplitQKV, SiluAndMul, SkipRMSNorm and the w8a8 row ops (builder/fused_ops.py): the C++
kernels and the ONNX function bodies against numpy."""
import json
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from builder.fused_ops import (ROTARY_OP_TYPE, SILU_OP_TYPE, SKIP_NORM_OP_TYPE, make_rotary_function,
                               make_silu_function, make_skip_norm_function)
from builder.onnx_graph import OPSET
from builder.paged_attention import DOMAIN
from tests.conftest import profile_prefix


def one_node_session(node, inputs, outputs, function, library=None):
    """A graph of one trtllm_lite node carrying its function; with ``library`` registered the
    kernel runs (profiled, to tell which ran)."""
    graph = helper.make_graph([node], "g", inputs, outputs)
    model = helper.make_model(graph, functions=[function],
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1),
                                             helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = profile_prefix()
    if library:
        so.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def ops_run(sess) -> set:
    """The op types ONNX Runtime's profile saw run (the profile file is removed)."""
    path = sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    return {e["args"].get("op_name") for e in events if e.get("cat") == "Node"}


def rotary_session(heads, kv_heads, head_dim, library=None):
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    node = helper.make_node(ROTARY_OP_TYPE, ["qkv", "positions", "cos", "sin"], ["q", "k", "v"], domain=DOMAIN,
                            num_heads=heads, num_kv_heads=kv_heads)
    inputs = [helper.make_tensor_value_info("qkv", f32, ["T", (heads + 2 * kv_heads) * head_dim]),
              helper.make_tensor_value_info("positions", i64, ["T"]),
              helper.make_tensor_value_info("cos", f32, ["P", head_dim // 2]),
              helper.make_tensor_value_info("sin", f32, ["P", head_dim // 2])]
    outputs = [helper.make_tensor_value_info(n, f32, None) for n in ("q", "k", "v")]
    return one_node_session(node, inputs, outputs, make_rotary_function(heads, kv_heads, head_dim), library)


def rotary_reference(qkv, positions, cos, sin, heads, kv_heads):
    """Rotate-half rotary embedding (HF Llama's ``apply_rotary_pos_emb``) in float64."""
    t, d = len(positions), cos.shape[1] * 2
    x = qkv.astype(np.float64).reshape(t, heads + 2 * kv_heads, d)
    c = np.concatenate([cos[positions]] * 2, axis=-1)[:, None].astype(np.float64)
    s = np.concatenate([sin[positions]] * 2, axis=-1)[:, None].astype(np.float64)
    qk = x[:, :heads + kv_heads]
    rotated = qk * c + np.concatenate([-qk[..., d // 2:], qk[..., :d // 2]], axis=-1) * s
    return rotated[:, :heads], rotated[:, heads:], x[:, heads + kv_heads:]


def rotary_inputs(rng, tokens, heads, kv_heads, head_dim, max_pos=64):
    angles = np.outer(np.arange(max_pos), 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim))
    return {"qkv": rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim)).astype(np.float32),
            "positions": rng.integers(0, max_pos, tokens).astype(np.int64),
            "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}


@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [
    (9, 3, 64, 1), (9, 3, 64, 37), (4, 4, 16, 5), (8, 1, 128, 20), (4, 2, 12, 9),
    (9, 3, 64, 301),    # enough work to go to the thread pool (kSerialWork), with a partial item
])
def test_rotary_split_qkv_matches_reference(op_library, heads, kv_heads, head_dim, tokens):
    """The kernel (both builds) and the function body against the float64 reference, and
    the profile shows which ran."""
    with_kernel = op_library is not None
    feed = rotary_inputs(np.random.default_rng(0), tokens, heads, kv_heads, head_dim)
    sess = rotary_session(heads, kv_heads, head_dim, op_library)
    got = sess.run(None, feed)
    assert (ROTARY_OP_TYPE in ops_run(sess)) is with_kernel
    for g, want in zip(got, rotary_reference(feed["qkv"], feed["positions"], feed["cos"], feed["sin"],
                                             heads, kv_heads)):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_rotary_kernel_rejects_positions_outside_the_tables(kernel_library):
    """A position past the rotary tables is an INVALID_ARGUMENT naming ``positions``; the
    session goes on."""
    sess = rotary_session(9, 3, 64, kernel_library)
    feed = rotary_inputs(np.random.default_rng(1), 4, 9, 3, 64)
    feed["positions"][2] = 64
    with pytest.raises(Exception, match=r"positions\[2\] = 64 outside the rotary tables' 64 positions"):
        sess.run(None, feed)
    feed["positions"][2] = 63
    assert all(np.isfinite(x).all() for x in sess.run(None, feed))


def silu_session(library=None):
    f32 = TensorProto.FLOAT
    node = helper.make_node(SILU_OP_TYPE, ["gate_up"], ["out"], domain=DOMAIN)
    return one_node_session(node, [helper.make_tensor_value_info("gate_up", f32, ["T", "W"])],
                            [helper.make_tensor_value_info("out", f32, None)], make_silu_function(), library)


@pytest.mark.parametrize("tokens,width", [(1, 1536), (33, 1536), (3, 40), (2, 7), (203, 1536)])
def test_silu_and_mul_matches_reference(op_library, tokens, width):
    """Including inputs far out in both tails (silu(-100) = -0, silu(100) = 100) and widths
    that are not a multiple of the vector width. (The function body runs ONNX Runtime's
    QuickGelu fusion, whose sigmoid is approximate: looser there.)"""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((tokens, 2 * width)) * 4).astype(np.float32)
    x[0, :3] = [-100.0, 100.0, 0.0]
    with_kernel = op_library is not None
    sess = silu_session(op_library)
    (got,) = sess.run(None, {"gate_up": x})
    assert (SILU_OP_TYPE in ops_run(sess)) is with_kernel
    g, up = x[:, :width].astype(np.float64), x[:, width:].astype(np.float64)
    want = g / (1 + np.exp(-g)) * up
    tolerance = dict(rtol=2e-6, atol=1e-6) if with_kernel else dict(rtol=1e-3, atol=2e-5)
    np.testing.assert_allclose(got, want, **tolerance)


def test_silu_and_mul_at_extreme_gates(op_library):
    """Gates far below exp's range in the vector lanes (16 and 8 wide) and the scalar tail
    (width 25): silu(-3e38) is -0, not the -4.9 of a clamped exp (QA), -inf gives NaN as
    float32's formula does, and every other lane of a vector holding one such gate stays right."""
    extremes = [-3e38, -1e36, -1e20, -1e4, -100.0, -88.0, -87.5, -np.inf, np.inf, -0.0]
    rng = np.random.default_rng(5)
    gates = (rng.standard_normal((3, 25)) * 4).astype(np.float32)
    gates[0, :len(extremes)] = extremes                 # the first vector of each width
    gates[1, 14:14 + len(extremes)] = extremes          # across vector boundaries
    gates[2, 24] = -3e38                                # the scalar tail
    ups = np.ones_like(gates)
    ups[0, 2] = 1e20
    x = np.concatenate([gates, ups], axis=1)
    (got,) = silu_session(op_library).run(None, {"gate_up": x})
    g, up = gates.astype(np.float64), ups.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = g / (1 + np.exp(-g)) * up
    rtol = 2e-6 if op_library is not None else 1e-3
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-30, equal_nan=True)


def skip_norm_session(epsilon, library=None):
    f32 = TensorProto.FLOAT
    node = helper.make_node(SKIP_NORM_OP_TYPE, ["x", "skip", "gamma"], ["y", "sum"], domain=DOMAIN, epsilon=epsilon)
    inputs = [helper.make_tensor_value_info("x", f32, ["T", "H"]),
              helper.make_tensor_value_info("skip", f32, ["T", "H"]),
              helper.make_tensor_value_info("gamma", f32, ["H"])]
    outputs = [helper.make_tensor_value_info(n, f32, None) for n in ("y", "sum")]
    return one_node_session(node, inputs, outputs, make_skip_norm_function(epsilon), library)


@pytest.mark.parametrize("tokens,width", [(1, 576), (7, 576), (8, 576), (9, 40), (16, 576), (37, 576), (203, 960),
                                          (3, 5)])
def test_skip_rms_norm_is_onnx_runtimes_skip_norm_bit_for_bit(op_library, tokens, width):
    """The kernel adds each row's squares in ONNX Runtime's order (several rows side by side):
    its outputs are the function body's (``SkipSimplifiedLayerNormalization``) bit for bit, at
    row counts on both sides of its 8- and 16-row groups, and both are RMSNorm (float64 numpy)."""
    rng = np.random.default_rng(tokens * 1000 + width)
    feeds = {"x": (rng.standard_normal((tokens, width)) * 3).astype(np.float32),
             "skip": (rng.standard_normal((tokens, width)) * 3).astype(np.float32),
             "gamma": rng.standard_normal(width).astype(np.float32)}
    sess = skip_norm_session(1e-5, op_library)
    y, total = sess.run(None, feeds)
    assert (SKIP_NORM_OP_TYPE in ops_run(sess)) is (op_library is not None)
    body_y, body_total = skip_norm_session(1e-5).run(None, feeds)
    np.testing.assert_array_equal(y, body_y)
    np.testing.assert_array_equal(total, body_total)
    x = feeds["x"].astype(np.float64) + feeds["skip"]
    want = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-5) * feeds["gamma"]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(total, feeds["x"] + feeds["skip"])


def test_skip_rms_norm_rejects_mismatched_shapes(kernel_library):
    sess = skip_norm_session(1e-5, kernel_library)
    with pytest.raises(Exception, match=r"SkipRMSNorm: input \[2, 4\], skip \[2, 4\], gamma \[3\] are not"):
        sess.run(None, {"x": np.zeros((2, 4), np.float32), "skip": np.zeros((2, 4), np.float32),
                        "gamma": np.zeros(3, np.float32)})


def test_silu_and_mul_rejects_an_odd_width(kernel_library):
    sess = silu_session(kernel_library)
    with pytest.raises(Exception, match=r"gate_up \[2, 7\] is not \[T, 2 \* I\]"):
        sess.run(None, {"gate_up": np.zeros((2, 7), np.float32)})


def test_kernels_read_any_rank_up_to_eight_and_name_the_input_past_it(kernel_library):
    """Input shapes are read into an inline shape of up to 8 dimensions (without allocating,
    where ONNX Runtime 1.24's shape reference is there; the portable build reads them the older
    way): a rank-3 input gets the op's own shape error with its dimensions, a rank-9 input an
    INVALID_ARGUMENT naming the input and the limit."""
    node = helper.make_node(SILU_OP_TYPE, ["gate_up"], ["out"], domain=DOMAIN)
    sess = one_node_session(node, [helper.make_tensor_value_info("gate_up", TensorProto.FLOAT, None)],
                            [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], make_silu_function(),
                            kernel_library)
    with pytest.raises(Exception, match=r"gate_up \[1, 2, 8\] is not \[T, 2 \* I\]"):
        sess.run(None, {"gate_up": np.zeros((1, 2, 8), np.float32)})
    with pytest.raises(Exception, match=r"input 0 has rank 9, above the kernels' 8"):
        sess.run(None, {"gate_up": np.zeros((1,) * 8 + (2,), np.float32)})


def offsets_session(block_size, library=None):
    from builder.fused_ops import OFFSETS_OP_TYPE, make_offsets_function

    f32 = TensorProto.FLOAT
    node = helper.make_node(OFFSETS_OP_TYPE, ["y", "x", "offsets", "block_sum_matrix"], ["out"], domain=DOMAIN,
                            block_size=block_size)
    inputs = [helper.make_tensor_value_info(n, f32, None) for n in ("y", "x", "offsets", "block_sum_matrix")]
    return one_node_session(node, inputs, [helper.make_tensor_value_info("out", f32, None)],
                            make_offsets_function(), library)


@pytest.mark.parametrize("rows,n,blocks,block_size", [(1, 960, 18, 32), (5, 3072, 18, 32), (70, 37, 3, 32),
                                                      (2, 576, 48, 32), (9, 100, 4, 16)])
@pytest.mark.parametrize("offsets_kind", ["float32", "float16-exact"])
def test_add_block_offsets_matches_reference(op_library, rows, n, blocks, block_size, offsets_kind):
    """y + blocksum(x) @ offsets^T (Q4_1's block mins) against numpy, register tiles with
    partial row and column tiles included; the same node runs twice (the kernel transposes
    the constant offsets once)."""
    from builder.fused_ops import OFFSETS_OP_TYPE

    rng = np.random.default_rng(5)
    k = blocks * block_size
    feed = {"y": rng.standard_normal((rows, n)).astype(np.float32),
            "x": rng.standard_normal((rows, k)).astype(np.float32),
            "offsets": rng.standard_normal((n, blocks)).astype(np.float32),
            "block_sum_matrix": np.repeat(np.eye(blocks, dtype=np.float32), block_size, axis=0)}
    with_kernel = op_library is not None
    if offsets_kind == "float16-exact":     # as GGUF's Q4_1 mins are: the kernel streams them as float16
        feed["offsets"] = feed["offsets"].astype(np.float16).astype(np.float32)
    sess = offsets_session(block_size, op_library)
    want = feed["y"] + feed["x"].astype(np.float64).reshape(rows, blocks, block_size).sum(-1) @ feed["offsets"].T
    for _ in range(2):
        (got,) = sess.run(None, feed)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert (OFFSETS_OP_TYPE in ops_run(sess)) is with_kernel


def test_add_block_offsets_rejects_mismatched_shapes(kernel_library):
    sess = offsets_session(32, kernel_library)
    feed = {"y": np.zeros((2, 8), np.float32), "x": np.zeros((2, 64), np.float32),
            "offsets": np.zeros((8, 3), np.float32), "block_sum_matrix": np.zeros((64, 2), np.float32)}
    with pytest.raises(Exception, match=r"AddBlockOffsets: y \[2, 8\], x \[2, 64\] and offsets \[8, 3\]"):
        sess.run(None, feed)


def quantize_rows_session(library=None, shape=("T", "K"), planes=1):
    from builder.fused_ops import QUANTIZE_ROWS_OP_TYPE, make_quantize_rows_function

    node = helper.make_node(QUANTIZE_ROWS_OP_TYPE, ["x"], ["q", "scale"], domain=DOMAIN, planes=planes)
    return one_node_session(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                            [helper.make_tensor_value_info("q", TensorProto.UINT8, None),
                             helper.make_tensor_value_info("scale", TensorProto.FLOAT, None)],
                            make_quantize_rows_function(), library)


def quantize_rows_reference(x, planes=1):
    """Per-row uint8 codes in float32 arithmetic, as the op defines them (fused_ops.py):
    ``s = max(max |x| * (1 / 127), 1e-30 / 127)``, ``v = x * (1 / s)``, ``q = rint(v) + 128``
    (half to even); the second plane ``rint((v - rint(v)) * 254) + 128`` with scale ``s / 254``."""
    f32 = np.float32
    top = np.abs(x).max(axis=1, keepdims=True) if x.shape[1] else np.zeros((len(x), 1), f32)
    scale = np.maximum(top * f32(1 / 127), f32(1e-30 / 127)).astype(f32)
    v = (x * (f32(1) / scale)).astype(f32)
    r = np.rint(v)
    q = [np.clip(r, -128, 127) + 128]
    scales = [scale]
    if planes == 2:
        q.append(np.clip(np.rint((v - r) * f32(254)), -128, 127) + 128)
        scales.append((scale / f32(254)).astype(f32))
    return np.concatenate(q).astype(np.uint8), np.concatenate(scales)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("tokens,width", [(3, 37), (64, 576), (301, 960)])
def test_quantize_rows_matches_reference(op_library, tokens, width, planes):
    """Codes and scales bit for bit against numpy (the scalar tail at width 37, vector widths,
    the thread pool at 301 x 960), with an all-zero row, exact ties (half to even), a row whose largest value
    is negative, and values far apart in size; dequantized, each value within half a step of
    the last plane (1 / 127 of the row's largest value; 1 / 32,258 with two planes)."""
    from builder.fused_ops import QUANTIZE_ROWS_OP_TYPE

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((tokens, width)) * 3).astype(np.float32)
    x[0, :3] = [-127.0, 2.5, -0.5]             # scale 1: 2.5 -> 2 and -0.5 -> -0 (half to even)
    if tokens > 2:
        x[1] = 0.0
        x[2, 0] = -1e30
    sess = quantize_rows_session(op_library, planes=planes)
    q, scale = sess.run(None, {"x": x})
    assert (QUANTIZE_ROWS_OP_TYPE in ops_run(sess)) is (op_library is not None)
    want_q, want_scale = quantize_rows_reference(x, planes)
    np.testing.assert_array_equal(scale, want_scale)
    np.testing.assert_array_equal(q, want_q)
    assert q[0, :3].tolist() == [1, 130, 128]
    codes = (q.astype(np.float64) - 128) * scale
    got = codes.reshape(planes, tokens, width).sum(axis=0)
    step = scale[-tokens:].astype(np.float64)
    assert (np.abs(got - x) <= 0.5 * step * (1 + 1e-6) + 3e-7 * np.abs(x)).all()   # (+ v's float32 rounding)


@pytest.mark.parametrize("planes", [1, 2])
def test_quantize_rows_non_finite_rows_come_out_nan(op_library, planes):
    """A row holding a NaN or an infinity (in the vector part or the scalar tail) gets scale
    NaN in every plane, so DequantizeRows makes its output row NaN, as float32 would; the
    other rows keep their exact codes and scales."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 37)).astype(np.float32)
    x[1, 3], x[2, 20], x[3, 36] = np.nan, np.inf, -np.inf
    q, scale = quantize_rows_session(op_library, planes=planes).run(None, {"x": x})
    scale = scale.reshape(planes, 5)
    assert np.isnan(scale[:, 1:4]).all() and np.isfinite(scale[:, [0, 4]]).all()
    want_q, want_scale = quantize_rows_reference(x[[0, 4]], planes)
    np.testing.assert_array_equal(scale[:, [0, 4]].reshape(-1, 1), want_scale)
    np.testing.assert_array_equal(q.reshape(planes, 5, 37)[:, [0, 4]].reshape(-1, 37), want_q)
    y = rng.standard_normal((planes * 5, 8)).astype(np.float32)
    (out,) = dequantize_rows_session(op_library, planes).run(
        None, {"y": y, "scale": scale.reshape(-1, 1), "bias": np.zeros(8, np.float32)})
    assert np.isnan(out[1:4]).all() and np.isfinite(out[[0, 4]]).all()


def test_quantize_rows_rejects_a_vector_and_a_plane_count(kernel_library):
    sess = quantize_rows_session(kernel_library, shape=None)
    with pytest.raises(Exception, match=r"QuantizeRows: x \[7\] is not \[T, K\]"):
        sess.run(None, {"x": np.zeros(7, np.float32)})
    with pytest.raises(Exception, match="QuantizeRows: planes must be 1 or 2, got 3"):
        quantize_rows_session(kernel_library, planes=3)


def dequantize_rows_session(library=None, planes=1):
    from builder.fused_ops import DEQUANTIZE_ROWS_OP_TYPE, make_dequantize_rows_function

    f32 = TensorProto.FLOAT
    node = helper.make_node(DEQUANTIZE_ROWS_OP_TYPE, ["y", "scale", "bias"], ["out"], domain=DOMAIN, planes=planes)
    return one_node_session(node, [helper.make_tensor_value_info(n, f32, None) for n in ("y", "scale", "bias")],
                            [helper.make_tensor_value_info("out", f32, None)], make_dequantize_rows_function(), library)


@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("tokens,n", [(5, 37), (301, 576)])
def test_dequantize_rows_matches_reference(op_library, tokens, n, planes):
    """sum over planes of y * scale, + bias, against float64 numpy (within float32 rounding of
    the terms: the planes may cancel)."""
    from builder.fused_ops import DEQUANTIZE_ROWS_OP_TYPE

    rng = np.random.default_rng(8)
    feed = {"y": rng.standard_normal((planes * tokens, n)).astype(np.float32) * 1e4,
            "scale": rng.random((planes * tokens, 1)).astype(np.float32),
            "bias": rng.standard_normal(n).astype(np.float32)}
    sess = dequantize_rows_session(op_library, planes)
    (got,) = sess.run(None, feed)
    assert (DEQUANTIZE_ROWS_OP_TYPE in ops_run(sess)) is (op_library is not None)
    scaled = (feed["y"].astype(np.float64) * feed["scale"]).reshape(planes, tokens, n)
    want = scaled.sum(axis=0) + feed["bias"]
    magnitude = np.abs(scaled).sum(axis=0) + np.abs(feed["bias"])    # float32 rounding of each term
    assert (np.abs(got - want) <= 5e-7 * magnitude + 1e-6).all()


def test_dequantize_rows_rejects_mismatched_shapes(kernel_library):
    sess = dequantize_rows_session(kernel_library, planes=2)
    feed = {"y": np.zeros((3, 8), np.float32), "scale": np.zeros((3, 1), np.float32), "bias": np.zeros(8, np.float32)}
    with pytest.raises(Exception, match=r"DequantizeRows: y \[3, 8\], scale \[3, 1\] and bias \[8\] are not "
                                        r"\[2 T, N\], \[2 T, 1\] and \[N\]"):
        sess.run(None, feed)


def block_hadamard_session(library=None):
    from builder.fused_ops import BLOCK_HADAMARD_OP_TYPE, make_block_hadamard_function

    f32 = TensorProto.FLOAT
    node = helper.make_node(BLOCK_HADAMARD_OP_TYPE, ["x", "hadamard"], ["out"], domain=DOMAIN)
    return one_node_session(node, [helper.make_tensor_value_info(n, f32, None) for n in ("x", "hadamard")],
                            [helper.make_tensor_value_info("out", f32, None)], make_block_hadamard_function(), library)


@pytest.mark.parametrize("tokens,width,block", [(3, 1536, 256), (70, 96, 32), (5, 24, 8), (2, 6, 2), (4, 5, 1),
                                                (0, 64, 16)])
def test_block_hadamard_matches_reference(op_library, tokens, width, block):
    """Each row's blocks times the normalized Hadamard matrix, against float64 numpy (the
    kernel's fast transform and the body's MatMul; blocks under the 16-float vector too)."""
    from builder.fused_ops import BLOCK_HADAMARD_OP_TYPE
    from builder.rotation import hadamard_matrix

    rng = np.random.default_rng(9)
    x = (rng.standard_normal((tokens, width)) * 3).astype(np.float32)
    if tokens:
        x[0, 1] = 1e4   # an outlier: spread over its block
    h = hadamard_matrix(block)
    sess = block_hadamard_session(op_library)
    (got,) = sess.run(None, {"x": x, "hadamard": h.astype(np.float32)})
    assert (BLOCK_HADAMARD_OP_TYPE in ops_run(sess)) is (op_library is not None)
    blocks = (tokens, width // block, block)
    want = (x.astype(np.float64).reshape(blocks) @ h).reshape(tokens, width)
    magnitude = np.abs(x.astype(np.float64)).reshape(blocks).sum(-1, keepdims=True) / np.sqrt(block)
    assert got.shape == want.shape
    assert (np.abs(got - want).reshape(blocks) <= 1e-6 * magnitude + 1e-7).all()


def test_block_hadamard_rejects_a_block_that_does_not_divide_the_row(kernel_library):
    sess = block_hadamard_session(kernel_library)
    with pytest.raises(Exception, match=r"BlockHadamard: hadamard \[12, 12\] is not \[b, b\] with b a power "
                                        r"of two dividing K = 24"):
        sess.run(None, {"x": np.zeros((2, 24), np.float32), "hadamard": np.zeros((12, 12), np.float32)})
    with pytest.raises(Exception, match=r"hadamard \[16, 16\] is not \[b, b\] with b a power of two dividing K = 24"):
        sess.run(None, {"x": np.zeros((2, 24), np.float32), "hadamard": np.zeros((16, 16), np.float32)})
    # the kernel computes H_b's transform: any other [b, b] matrix (the body would multiply by it) is refused
    with pytest.raises(Exception, match=r"BlockHadamard: hadamard is not the normalized Sylvester Hadamard "
                                        r"matrix of size 4"):
        sess.run(None, {"x": np.ones((2, 24), np.float32), "hadamard": np.eye(4, dtype=np.float32)})
    from builder.rotation import hadamard_matrix
    (got,) = sess.run(None, {"x": np.ones((2, 24), np.float32), "hadamard": hadamard_matrix(4).astype(np.float32)})
    np.testing.assert_allclose(got, np.tile([2.0, 0, 0, 0], (2, 6)), atol=1e-6)
