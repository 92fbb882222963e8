"""The TensorRT and TensorRT-RTX backends (``--backend tensorrt`` / ``tensorrt-rtx``).

What runs on these CPU machines:
  * TensorRT-RTX builds a real engine (prefill and decode optimization profiles) from a tiny
    model's graphs (it inlines the PagedAttention function body; no GPU needed to build);
  * the TensorRT graph variant (``kv_write="in_op"``: the op writes the pools and returns them)
    passes ``onnx.checker`` and, run by ONNX Runtime, gives the runtime graphs' logits and the
    pools the runtime's KV write gives;
  * the Python TensorRT plugin's launch path (argument derivation, in-place pool write through
    the aliased outputs) on the CPU emulation of the CUDA kernels, against the numpy reference;
  * the runner and plugin import without TensorRT and fail with the missing package's name.
What needs a GPU skips with the reason: running an engine (the TensorRT-RTX one against ONNX
Runtime's greedy tokens); full TensorRT cannot be installed here at all.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from builder.build import BuildConfig, build_engine
from builder.compile_tensorrt import PROFILES, ProfileLimits, profile_shapes
from builder.export_onnx import export_graphs
from builder.loaders import load_model
from builder.paged_attention import reference_paged_attention, write_kv_reference
from tests.conftest import make_tiny_hf
from trtllm_lite.engine_dir import EngineDir, load_engine_dir
from trtllm_lite.runners import tensorrt_runner as trt_runner

ROOT = Path(__file__).resolve().parents[1]
HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
HAS_TRT = importlib.util.find_spec("tensorrt") is not None
LIMITS = dict(max_seq_len=256, max_num_batched_tokens=256, max_num_seqs=16, block_size=4)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return make_tiny_hf("llama-gqa", str(tmp_path_factory.mktemp("trt") / "hf"))


@pytest.fixture(scope="module")
def rtx_engine(tiny_hf, tmp_path_factory):
    if not HAS_RTX:
        pytest.skip("tensorrt-rtx is not installed (pip install trtllm-lite[rtx])")
    out = str(tmp_path_factory.mktemp("trt") / "rtx")
    return build_engine(tiny_hf, out, BuildConfig(backend="tensorrt-rtx", **LIMITS))


# ---------------------------------------------------------------- TensorRT-RTX build

def test_rtx_builds_engine_with_prefill_and_decode_profiles(rtx_engine, tiny_hf):
    engine = load_engine_dir(rtx_engine, expected_backend="tensorrt-rtx")  # checksums incl. the plan
    info = engine.manifest["tensorrt"]
    assert engine.build["dtype"] == info["precision"] == "float32"
    assert info["kv_write"] == "runtime" and info["plan"] in engine.manifest["files"]
    assert os.path.getsize(engine.file(info["plan"])) > os.path.getsize(engine.file("weights.bin"))
    assert list(info["profiles"]) == list(PROFILES) and info["profile_index"] == {"prefill": 0, "decode": 1}
    prefill, decode = info["profiles"]["prefill"], info["profiles"]["decode"]
    assert prefill["input_ids"][2] == [256] and prefill["context_lens"][2] == [16]
    assert decode["input_ids"] == decode["context_lens"] == decode["logits_indices"]   # T = S = N
    assert decode["input_ids"][2] == [16] and prefill["block_tables"][2] == [16, 64]
    cfg = load_model(tiny_hf).config
    assert prefill["key_cache.1"][2] == [info["max_num_blocks"], 4, cfg.num_kv_heads, cfg.head_dim]
    assert info["max_num_blocks"] == 16 * 64
    # the graphs in the directory are the ONNX Runtime ones (new K/V returned to the runtime)
    outputs = [o.name for o in onnx.load(engine.file("prefill.onnx"), load_external_data=False).graph.output]
    assert outputs == ["logits", "new_keys", "new_values"]


def test_rtx_builds_float16_engine_from_the_mixed_precision_graph(tiny_hf, tmp_path):
    if not HAS_RTX:
        pytest.skip("tensorrt-rtx is not installed (pip install trtllm-lite[rtx])")
    out = build_engine(tiny_hf, str(tmp_path / "rtx16"), BuildConfig(backend="tensorrt-rtx", dtype="float16", **LIMITS))
    engine = load_engine_dir(out)
    info = engine.manifest["tensorrt"]
    assert info["precision"] == "float16" and info["graph"] == "prefill.float16.onnx"
    assert {"model.plan", "prefill.float16.onnx"} <= set(engine.manifest["files"])
    graph = onnx.load(engine.file(info["graph"]), load_external_data=False).graph
    f16 = onnx.TensorProto.FLOAT16
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.output)}
    assert types["key_cache.0"] == types["new_keys"] == f16 and types["logits"] == onnx.TensorProto.FLOAT


def test_profile_shapes_span_the_build_limits():
    limits = ProfileLimits(max_num_seqs=8, max_num_batched_tokens=100, max_seq_len=70, block_size=16)
    pre = profile_shapes("prefill", limits, (2, 64), num_layers=1)
    dec = profile_shapes("decode", limits, (2, 64), num_layers=1)
    for shapes in (pre, dec):
        for lo, opt, hi in shapes.values():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
    assert pre["input_ids"][2] == (100,) and pre["query_start_loc"][2] == (9,)
    assert dec["input_ids"][2] == dec["logits_indices"][2] == (8,)
    assert pre["block_tables"][2] == (8, 5) and pre["key_cache.0"][2] == (40, 16, 2, 64)
    with pytest.raises(ValueError, match="profile"):
        profile_shapes("verify", limits, (2, 64), 1)


def test_build_options_are_checked_per_backend():
    with pytest.raises(ValueError, match="--dtype 'float32'.*tensorrt backend builds float16 or bfloat16"):
        BuildConfig(backend="tensorrt", dtype="float32").validate(2048)
    with pytest.raises(ValueError, match="--dtype 'float64'.*tensorrt-rtx backend builds float32"):
        BuildConfig(backend="tensorrt-rtx", dtype="float64").validate(2048)
    with pytest.raises(ValueError, match="--quantization 'int4'"):
        BuildConfig(backend="tensorrt-rtx", quantization="int4").validate(2048)
    with pytest.raises(ValueError, match="--dtype 'bfloat16'.*onnxruntime"):
        BuildConfig(dtype="bfloat16").validate(2048)


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here")
def test_tensorrt_build_names_the_missing_package(tiny_hf, tmp_path):
    with pytest.raises(trt_runner.TensorRTUnavailable, match=r"'tensorrt'.*pip install trtllm-lite\[tensorrt\]"):
        build_engine(tiny_hf, str(tmp_path / "e"), BuildConfig(backend="tensorrt", dtype="float16", **LIMITS))
    assert not (tmp_path / "e").exists()  # nothing exported before the check


# ---------------------------------------------------------------- the in-op graph variant

def random_step(rng, cfg, num_blocks):
    """Two sequences with cached context in shuffled blocks, plus a decode of a third."""
    context, query = [5, 0, 9], [3, 4, 1]
    perm = rng.permutation(num_blocks)
    tables = np.stack([perm[0:5], perm[5:10], perm[10:15]]).astype(np.int64)
    slots = [tables[s, p // 4] * 4 + p % 4 for s in range(3) for p in range(context[s], context[s] + query[s])]
    qsl = np.concatenate([[0], np.cumsum(query)]).astype(np.int64)
    T = int(qsl[-1])
    return dict(input_ids=rng.integers(0, cfg.vocab_size, T).astype(np.int64),
                positions=np.concatenate([np.arange(c, c + q) for c, q in zip(context, query)]).astype(np.int64),
                slot_mapping=np.asarray(slots, np.int64), block_tables=tables,
                context_lens=np.asarray(context, np.int64), query_start_loc=qsl,
                logits_indices=(qsl[1:] - 1).astype(np.int64))


def test_in_op_graphs_check_and_match_the_runtime_graphs(tiny_hf, tmp_path):
    """ONNX Runtime runs the TensorRT graphs' function body: same logits as the ONNX Runtime
    graphs, and the pools it returns are the pools after the runtime's KV write."""
    loaded = load_model(tiny_hf)
    cfg = loaded.config
    sessions = {}
    for kv_write in ("runtime", "in_op"):
        graphs, store = export_graphs(cfg, loaded.weights, 256, kv_write=kv_write)
        store.write(str(tmp_path / store.filename))
        for kind, graph in graphs.items():
            path = str(tmp_path / f"{kind}.{kv_write}.onnx")
            onnx.save(graph, path)
            onnx.checker.check_model(path, full_check=True)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        sessions[kv_write] = ort.InferenceSession(str(tmp_path / f"prefill.{kv_write}.onnx"), so,
                                                  providers=["CPUExecutionProvider"])
    nodes = [n for n in onnx.load(str(tmp_path / "prefill.in_op.onnx"), load_external_data=False).graph.node
             if n.op_type == "PagedAttention"]
    assert len(nodes) == cfg.num_layers       # the parser's plugin lookup: name, namespace, version
    assert all(onnx.helper.get_attribute_value(a) == b"trtllm_lite" for n in nodes for a in n.attribute
               if a.name == "plugin_namespace")
    in_op_outputs = [o.name for o in sessions["in_op"].get_outputs()]
    assert in_op_outputs == ["logits"] + [f"{n}_out.{i}" for i in range(cfg.num_layers)
                                         for n in ("key_cache", "value_cache")]
    rng = np.random.default_rng(0)
    num_blocks = 20
    pools = {f"{n}.{i}": rng.standard_normal((num_blocks, 4, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
             for i in range(cfg.num_layers) for n in ("key_cache", "value_cache")}
    feeds = {**random_step(rng, cfg, num_blocks), **pools}
    logits, new_keys, new_values = sessions["runtime"].run(None, feeds)
    in_op = dict(zip(in_op_outputs, sessions["in_op"].run(None, feeds)))
    np.testing.assert_allclose(in_op["logits"], logits, rtol=1e-5, atol=1e-5)
    for i in range(cfg.num_layers):
        k, v = pools[f"key_cache.{i}"].copy(), pools[f"value_cache.{i}"].copy()
        write_kv_reference(k, v, new_keys[i], new_values[i], feeds["slot_mapping"])
        np.testing.assert_array_equal(in_op[f"key_cache_out.{i}"], k)
        np.testing.assert_array_equal(in_op[f"value_cache_out.{i}"], v)


def test_float16_graph_matches_float32_graph(tiny_hf, tmp_path):
    """The mixed-precision copy TensorRT builds 16-bit engines from, run by ONNX Runtime:
    float16 GEMMs and attention, float32 residual stream: logits and new K/V close to float32."""
    from builder.compile_tensorrt import mixed_precision

    loaded = load_model(tiny_hf)
    cfg = loaded.config
    graphs, store = export_graphs(cfg, loaded.weights, 256)
    store.write(str(tmp_path / store.filename))
    paths = {"float32": str(tmp_path / "p32.onnx"), "float16": str(tmp_path / "p16.onnx")}
    onnx.save(graphs["prefill"], paths["float32"])
    onnx.save(mixed_precision(graphs["prefill"], "float16"), paths["float16"])
    onnx.checker.check_model(paths["float16"], full_check=True)
    rng = np.random.default_rng(2)
    feeds = random_step(rng, cfg, 20)
    results = {}
    for dtype, path in paths.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        pools = {f"{n}.{i}": np.zeros((20, 4, cfg.num_kv_heads, cfg.head_dim), dtype)
                 for i in range(cfg.num_layers) for n in ("key_cache", "value_cache")}
        session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        results[dtype] = session.run(None, {**feeds, **pools})
    for ref, low in zip(results["float32"], results["float16"]):
        assert np.linalg.norm(low.astype(np.float64) - ref) / np.linalg.norm(ref) < 1e-2
    assert results["float16"][0].dtype == np.float32 and results["float16"][1].dtype == np.float16


def test_default_export_is_the_onnx_runtime_graph(tiny_hf):
    loaded = load_model(tiny_hf)
    default, _ = export_graphs(loaded.config, loaded.weights, 64)
    runtime, _ = export_graphs(loaded.config, loaded.weights, 64, kv_write="runtime")
    for kind in default:
        assert default[kind].SerializeToString() == runtime[kind].SerializeToString()
    with pytest.raises(ValueError, match="kv_write"):
        export_graphs(loaded.config, loaded.weights, 64, kv_write="plugin")


# ---------------------------------------------------------------- the Python plugin's launch

@pytest.fixture(scope="module")
def emulated_kernels(emulated_cuda_library):
    """The CUDA kernels built for the CPU emulation (plugins_cu/emulation), loaded."""
    from trtllm_lite import cuda as tlcuda

    tlcuda.use_library(emulated_cuda_library)
    yield tlcuda
    tlcuda.use_library(None)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 6]], ids=["decode", "prefill"])
def test_plugin_launch_writes_pools_in_place_and_matches_reference(emulated_kernels, query_lens):
    tlcuda = emulated_kernels
    plugin = trt_runner.load_python_plugin()
    rng = np.random.default_rng(1)
    H, Hkv, D, B, dtype = 8, 2, 64, 16, "float16"
    context = [17, 0, 40]
    tables = rng.permutation(12)[:12].reshape(3, 4).astype(np.int64)
    slots = np.asarray([tables[s, p // B] * B + p % B for s in range(3)
                        for p in range(context[s], context[s] + query_lens[s])], np.int64)
    T = len(slots)
    host = dict(query=rng.standard_normal((T, H, D)), key=rng.standard_normal((T, Hkv, D)),
                value=rng.standard_normal((T, Hkv, D)), key_cache=rng.standard_normal((12, B, Hkv, D)),
                value_cache=rng.standard_normal((12, B, Hkv, D)))
    host = {k: tlcuda.from_device_dtype(tlcuda.to_device_dtype(v.astype(np.float32), dtype), dtype)
            for k, v in host.items()}
    meta = dict(slot_mapping=slots, block_tables=tables, context_lens=np.asarray(context, np.int64),
                query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64))
    dev = {k: tlcuda.DeviceBuffer.from_array(tlcuda.to_device_dtype(v, dtype)) for k, v in host.items()}
    dev.update({k: tlcuda.DeviceBuffer.from_array(v) for k, v in meta.items()})
    out = tlcuda.DeviceBuffer(T * H * D * 2)
    out.fill_bytes(0xFF)                                   # NaN: every element must be written
    args = plugin.kernel_arguments((T, H, D), (12, B, Hkv, D), tables.shape, H, Hkv)
    assert args["max_query_len"] == (1 if query_lens == [1, 1, 1] else T)
    ws_size = plugin.workspace_bytes((T, H, D), tables.shape, (12, B, Hkv, D), H, Hkv)
    ws = tlcuda.DeviceBuffer(ws_size) if ws_size else None
    names = ("query", "key", "value", "key_cache", "value_cache", *meta)
    inputs = [dev[n].ptr for n in names]
    outputs = [out.ptr, dev["key_cache"].ptr, dev["value_cache"].ptr]   # aliased, as TensorRT binds them
    plugin.launch(dtype, args, D ** -0.5, inputs, outputs, ws.ptr if ws else 0, ws_size, 0)
    tlcuda.synchronize()
    result = tlcuda.from_device_dtype(out.download((T, H, D), np.float16), dtype)
    ref = reference_paged_attention(*(host[n].astype(np.float64) for n in names[:5]), tables,
                                    meta["context_lens"], meta["query_start_loc"], D ** -0.5)
    assert np.linalg.norm(result - ref) / np.linalg.norm(ref) < 1e-3
    k_ref, v_ref = host["key_cache"].copy(), host["value_cache"].copy()
    write_kv_reference(k_ref, v_ref, host["key"], host["value"], slots)
    k_dev = tlcuda.from_device_dtype(dev["key_cache"].download(k_ref.shape, np.float16), dtype)
    np.testing.assert_array_equal(k_dev, k_ref)


def test_python_and_cpp_plugins_declare_the_same_op():
    """Engines built with either plugin load with either: same name, version, namespace, fields."""
    from builder.paged_attention import DOMAIN, OP_TYPE, OP_VERSION

    plugin = trt_runner.load_python_plugin()
    assert (plugin.PLUGIN_NAME, plugin.PLUGIN_VERSION, plugin.PLUGIN_NAMESPACE) == (OP_TYPE, str(OP_VERSION), DOMAIN)
    cpp = (ROOT / "plugins_cu" / "tensorrt_plugin" / "PagedAttentionPlugin.cpp").read_text()
    for name, value in (("kName", OP_TYPE), ("kVersion", str(OP_VERSION)), ("kNamespace", DOMAIN)):
        assert f'{name} = "{value}"' in cpp
    for field in ("num_heads", "num_kv_heads", "scale"):
        assert f'PluginField("{field}"' in cpp
    assert plugin.ALIASES == {1: 3, 2: 4} and "outputIndex == 1 ? kKeyCache" in cpp


def test_plugin_arguments_reject_mismatched_heads():
    plugin = trt_runner.load_python_plugin()
    with pytest.raises(ValueError, match="num_kv_heads"):
        plugin.kernel_arguments((4, 8, 64), (10, 16, 4, 64), (2, 3), num_heads=8, num_kv_heads=2)


# ---------------------------------------------------------------- runner without TensorRT / GPU

def test_runner_imports_and_explains_what_is_missing(rtx_engine):
    engine = load_engine_dir(rtx_engine)
    with pytest.raises(ValueError, match=r"num_kv_blocks must be in \[1, 1024\]"):
        trt_runner.TensorRTRunner(engine, 5000)
    # an engine for full TensorRT: its package is named when it is missing
    manifest = json.loads(json.dumps(engine.manifest))
    manifest["build"]["backend"] = "tensorrt"
    if not HAS_TRT:
        with pytest.raises(trt_runner.TensorRTUnavailable, match="'tensorrt'"):
            trt_runner.TensorRTRunner(EngineDir(engine.path, manifest), 64)
    # the RTX engine: cuda-python missing, or no GPU (needed to run any TensorRT engine)
    from trtllm_lite import LLM

    with pytest.raises((trt_runner.TensorRTUnavailable, trt_runner.CudaUnavailable),
                       match="cuda-python|CUDA GPU"):
        LLM(rtx_engine, num_kv_blocks=64)
    no_plan = dataclasses.replace(engine, manifest={**engine.manifest, "tensorrt": None})
    with pytest.raises(ValueError, match="no TensorRT plan"):
        trt_runner.TensorRTRunner(no_plan, 64)


def gpu_skip_reason(rtx: bool) -> str | None:
    """Why a TensorRT engine cannot run here, or None."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return "cuda-python is not installed"
    err, count = rt.cudaGetDeviceCount()
    if err != rt.cudaError_t.cudaSuccess or not count:
        return f"no CUDA GPU ({err.name})"
    err, props = rt.cudaGetDeviceProperties(0)
    if rtx and (props.major, props.minor) == (9, 0):
        return "TensorRT-RTX engines do not run on Hopper (sm_90)"
    return None


@pytest.mark.gpu
def test_rtx_engine_generates_what_onnx_runtime_generates(rtx_engine, tiny_hf, tmp_path):
    reason = gpu_skip_reason(rtx=True)
    if reason:
        pytest.skip(reason)
    from trtllm_lite import LLM, SamplingParams

    ort_engine = build_engine(tiny_hf, str(tmp_path / "ort"), BuildConfig(**LIMITS))
    prompts = [[1, 5, 9], list(range(3, 40)), [7] * 60]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(ort_engine, num_kv_blocks=64).generate(prompts, params)]
    llm = LLM(rtx_engine, num_kv_blocks=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_scatter_runs_cover_every_token_once():
    rng = np.random.default_rng(3)
    for slots in ([], [7], [4, 5, 6, 7, 8, 20, 21, 3], rng.permutation(50)[:30]):
        runs = trt_runner.scatter_runs(np.asarray(slots, np.int64))
        tokens = [t for t0, _, n in runs for t in range(t0, t0 + n)]
        rebuilt = [s for _, s0, n in runs for s in range(s0, s0 + n)]
        assert tokens == list(range(len(slots))) and rebuilt == list(slots)
    assert trt_runner.scatter_runs(np.arange(12, 24)).tolist() == [[0, 12, 12]]
