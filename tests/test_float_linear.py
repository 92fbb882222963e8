"""FloatLinear (trtllm_lite/ort_kernels/float_linear.cc; builder.fused_ops.use_float_linears):
the kernel, each build, against numpy, and a float32 engine's FloatLinear graphs against its
Gemm graphs end to end."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from builder.fused_ops import FLOAT_LINEAR_OP_TYPE, float_linear_panels
from builder.onnx_graph import OPSET
from builder.paged_attention import DOMAIN


def float_linear_session(n, k, library):
    node = helper.make_node(FLOAT_LINEAR_OP_TYPE, ["x", "panels"], ["y"], domain=DOMAIN, N=n, K=k)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", "K"]),
                                            helper.make_tensor_value_info("panels", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_panels_layout():
    w = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    p = float_linear_panels(w)
    assert p.shape == (2, 3, 32) and p.dtype == np.float32
    assert p[1, 2, 7] == w[39, 2] and p[0, 1, 5] == w[5, 1]
    assert not p[1, :, 8:].any()          # rows past N are 0


@pytest.mark.parametrize("m,n,k", [
    (1, 576, 576), (1, 45, 7), (1, 32, 1), (1, 3072, 1536),    # batch 1: the two-stream loop (odd K too)
    (2, 576, 576), (13, 100, 64), (14, 64, 33), (15, 960, 576), (29, 50, 16),   # whole and partial tiles
    (64, 576, 1536), (300, 96, 576), (7, 70, 40),       # enough work for the thread pool, many tiles a panel
    (0, 64, 64), (3, 0, 8), (4, 16, 0),    # empty
])
def test_float_linear_matches_numpy(kernel_library, m, n, k):
    """y = x W^T against float64 numpy within float32 rounding of the sums (|x| |W| scaled)."""
    rng = np.random.default_rng(m * 1000 + n + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    sess = float_linear_session(n, k, kernel_library)
    y = sess.run(None, {"x": x, "panels": float_linear_panels(w)})[0]
    assert y.shape == (m, n) and y.dtype == np.float32
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert np.all(np.abs(y - ref) <= 1e-6 * scale + 1e-30)


def test_float_linear_refuses_wrong_shapes(kernel_library):
    sess = float_linear_session(40, 8, kernel_library)
    w = np.ones((40, 8), np.float32)
    with pytest.raises(Exception, match=r"x \[3, 9\] is not \[M, K\]"):
        sess.run(None, {"x": np.ones((3, 9), np.float32), "panels": float_linear_panels(w)})
    with pytest.raises(Exception, match=r"panels \[1, 8, 32\] is not \[2, 8, 32\]"):
        sess.run(None, {"x": np.ones((3, 8), np.float32), "panels": float_linear_panels(w[:32])})


def graph_ops(engine_dir, file) -> dict:
    import collections

    import onnx

    graph = onnx.load(f"{engine_dir}/{file}", load_external_data=False).graph
    return collections.Counter(n.op_type for n in graph.node)


def test_float32_engine_writes_float_linear_graphs(smollm2_engine):
    """A float32 onnxruntime build writes FloatLinear graphs beside the Gemm ones: each decoder
    layer one FloatDecoderLayer node, the lm_head a FloatLinear over the tied embedding's
    panels; their graphs read the panels and the embedding table (its Gather), not the layers'
    row-major weights, and each weight's panels are stored once for both graphs."""
    from trtllm_lite.engine_dir import load_engine_dir

    engine = load_engine_dir(smollm2_engine, verify_checksums=False)
    files = engine.manifest["graph_variants"]["float_linear_kernels"]
    assert files == {"prefill": "prefill.kernels.float_linear.onnx", "decode": "decode.kernels.float_linear.onnx"}
    layers = engine.model["num_layers"]
    for file in files.values():
        ops = graph_ops(smollm2_engine, file)
        assert ops["FloatDecoderLayer"] == layers and ops["FloatLinear"] == 1 and "Gemm" not in ops
        read = set(engine.manifest["graph_weights"][file])
        assert "embed.weight" in read and "embed.weight.panels" in read
        assert not any(name.startswith("layers.") and name.endswith(".weight") and "norm" not in name
                       for name in read)
    tensors = engine.manifest["weights"]["tensors"]
    assert tensors["embed.weight.panels"]["shape"] == [49152 // 32, 576, 32]
    assert sum(name.endswith(".panels") for name in tensors) == 4 * layers + 1
    # the bandwidth bound counts a step's weights once (the panels are the same bytes again)
    from tools.bench_bounds import decode_bytes_per_step

    assert 537e6 < decode_bytes_per_step(engine.manifest) < 539e6


def test_quantized_engines_have_no_float_linear_graphs(tiny_model):
    from trtllm_lite.engine_dir import load_engine_dir

    _, engine_dir = tiny_model("llama-gqa", quantization="int4")
    assert not load_engine_dir(engine_dir, verify_checksums=False).manifest["graph_variants"]["float_linear_kernels"]


@pytest.mark.parametrize("kind", ["qwen2-bias", "gpt2"])
def test_engines_with_other_linears_have_no_float_linear_graphs(tiny_model, kind):
    """A float32 engine gets FloatLinear graphs only where every linear becomes one: Qwen2's
    biased QKV and GPT-2's biased linears stay Gemm, so their engines keep the Gemm graphs
    (the runner holds FloatLinear graphs' weights itself, and a Gemm beside them would keep a
    prepacked copy too), and no panels are stored."""
    from trtllm_lite.engine_dir import load_engine_dir

    _, engine_dir = tiny_model(kind)
    m = load_engine_dir(engine_dir, verify_checksums=False).manifest
    assert not m["graph_variants"]["float_linear_kernels"]
    assert not any(name.endswith(".panels") for name in m["weights"]["tensors"])


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mqa", "mistral"])
def test_float_linear_graphs_match_the_gemm_graphs(tiny_model, kind, monkeypatch):
    """The same requests through the FloatLinear graphs and the Gemm graphs (two runners, one
    engine): logits within float32 rounding, greedy tokens equal, for prompts and decodes. On a
    CPU without AVX-512, where the runner keeps the Gemm graphs, the FloatLinear ones are taken
    anyway (the kernel's AVX2 or portable loops), so the graphs are checked on every CPU."""
    import trtllm_lite.runners.onnxruntime_runner as ort_runner
    from trtllm_lite.engine_dir import load_engine_dir
    from trtllm_lite.ort_kernels import library_path
    from trtllm_lite.runners.base import ScheduledSeq, StepBatch
    from trtllm_lite.runners.onnxruntime_runner import OnnxRuntimeRunner, OrtOptions

    if library_path() is None:
        pytest.skip("trtllm-lite's kernels do not build here (no C++ compiler)")
    if not ort_runner.uses_float_linears(OrtOptions()):   # (no AVX-512: the selection alone is forced)
        monkeypatch.setattr(ort_runner, "uses_float_linears",
                            lambda options: options.float_linear_kernels and ort_runner.kernels_registered(options))
    _, engine_dir = tiny_model(kind)
    engine = load_engine_dir(engine_dir, verify_checksums=False)
    runners = [OnnxRuntimeRunner(engine, 64, options=OrtOptions(float_linear_kernels=on)) for on in (True, False)]
    assert runners[0].graph_files["prefill"] == "prefill.kernels.float_linear.onnx"
    assert runners[1].graph_files["prefill"] == "prefill.kernels.onnx"
    ops = graph_ops(engine_dir, "prefill.kernels.float_linear.onnx")
    assert ops["FloatDecoderLayer"] == 2 and ops["FloatLinear"] == 1 and "Gemm" not in ops
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 9, 40)]
    tables = [[0, 1, 2, 3, 4, 5, 6, 7], [10, 9, 8, 17, 16, 11, 12, 13], [20, 31, 22, 23, 40, 41, 42, 43, 44, 45, 46, 47]]
    seqs = [[ScheduledSeq(list(p), t, 0, len(p)) for p, t in zip(prompts, tables)] for _ in runners]
    logits = [r.execute(StepBatch(prefill=s)) for r, s in zip(runners, seqs)]
    for _ in range(3):
        np.testing.assert_allclose(logits[0], logits[1], atol=2e-5, rtol=2e-5)
        assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()
        for r_seqs in seqs:   # (both take the Gemm graphs' tokens)
            for s, row in zip(r_seqs, logits[1]):
                s.token_ids.append(int(row.argmax()))
                s.start, s.num_new_tokens = len(s.token_ids) - 1, 1
        logits = [r.execute(StepBatch(decode=s)) for r, s in zip(runners, seqs)]
    np.testing.assert_allclose(logits[0], logits[1], atol=2e-5, rtol=2e-5)
