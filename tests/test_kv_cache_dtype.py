"""``--kv-cache-dtype float16``: KV pools of half the bytes, against HF transformers and the
float32 engine built from the same tiny random checkpoint.

The tolerance: the float16 pools round each cached K/V element to 11 significant bits
(relative error <= 2^-11 ~ 4.9e-4, round to nearest even), the step's own new K/V too (the op
attends them as the pool will hold them); the attention itself runs in float32. Over two
layers that moved the tiny models' logits (scale ~3) by 5e-4 to 1.7e-3 at most (llama GQA /
MQA / MHA, head_dim 12, gpt2; the steps of run_steps, C++ kernel), while the float32 engine
stays within 2e-6 of HF. The bound here, 1e-2, is ~6x the largest seen.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import onnx
import pytest
import torch

from trtllm_lite import LLM, SamplingParams
from trtllm_lite.engine_dir import EngineDir, EngineError, load_engine_dir
from trtllm_lite.runners.base import ScheduledSeq, StepBatch
from trtllm_lite.runners.onnxruntime_runner import OnnxRuntimeRunner, OrtOptions


FLOAT16_LOGITS_ATOL = 1e-2     # module docstring
FLOAT16 = {"kv_cache_dtype": "float16"}


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def run_steps(runner: OnnxRuntimeRunner, after_step=None) -> tuple[list[np.ndarray], list[list[int]]]:
    """Steps that take each of the attention body's branches (block size 4): three prompts
    (1, 11, 12 tokens: the general body); a decode of all three at contexts 1 / 11 / 12 (3 of
    3 blocks used of each row: the padded decode); one at 2 / 12 / 13 (ragged: 8 of 12 blocks);
    the third sequence alone computing 3 tokens after 14 cached (one sequence: GQA); the first
    two computing 2 tokens each (the general body over cached context). The decoded tokens are
    the greedy ones; ``after_step()`` runs after each step. Returns each step's logits and the
    sequences' tokens."""
    after_step = after_step or (lambda: None)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 11, 12)]
    tables = [[0, 1, 2, 3, 4], [10, 9, 8, 7, 6], [20, 31, 22, 23, 40]]
    seqs = [ScheduledSeq(list(p), t, 0, len(p)) for p, t in zip(prompts, tables)]
    steps = [runner.execute(StepBatch(prefill=seqs))]
    after_step()
    for _ in range(2):
        for s, row in zip(seqs, steps[-1]):
            s.token_ids.append(int(row.argmax()))
            s.start, s.num_new_tokens = len(s.token_ids) - 1, 1
        steps.append(runner.execute(StepBatch(decode=seqs)))
        after_step()
    plan = [([seqs[2]], 3), (seqs[:2], 2)]
    for group, n in plan:
        for s in group:
            s.token_ids += rng.integers(0, 256, n).tolist()
            s.start, s.num_new_tokens, s.num_logits = len(s.token_ids) - n, n, n
        steps.append(runner.execute(StepBatch(prefill=group)))
        after_step()
    return steps, [s.token_ids for s in seqs]


def reference_rows(hf, tokens: list[list[int]]) -> list[np.ndarray]:
    """HF's logits for the rows :func:`run_steps` returns, in its order."""
    full = [hf_logits(hf, ids) for ids in tokens]
    prompt = (1, 11, 12)
    rows = [np.stack([full[s][prompt[s] - 1] for s in range(3)])]
    for k in range(2):
        rows.append(np.stack([full[s][prompt[s] + k] for s in range(3)]))
    rows.append(full[2][prompt[2] + 2:prompt[2] + 5])
    rows.append(np.concatenate([full[s][prompt[s] + 2:prompt[s] + 4] for s in range(2)]))
    return rows


@pytest.mark.parametrize("path", ["function-bodies", "kernels"])
def test_float16_kv_cache_logits_match_hf_within_its_rounding(tiny_model, path, tmp_path):
    """Each attention branch of the function body (the engine's graphs) and trtllm-lite's C++
    kernel (the kernels' graphs, which store the K/V in the op), on float16 pools: logits within float16 rounding of HF's (and the float32 engine's within float32's),
    greedy ids as the float32 engine's; and a prompt computed whole or in two chunks (the
    second over the first's cached, rounded K/V) gives the same logits within float32
    rounding: the step's own K/V are attended rounded as the pool holds them."""
    from trtllm_lite.ort_kernels import library_path

    kernels = path == "kernels"
    if kernels and library_path() is None:
        pytest.skip("trtllm-lite's kernels do not build here (no C++ compiler)")
    hf, engine16 = tiny_model("llama-gqa", **FLOAT16)
    _, engine32 = tiny_model("llama-gqa")
    runners = {}
    for name, engine_dir in (("16", engine16), ("32", engine32), ("16-chunked", engine16)):
        runners[name] = OnnxRuntimeRunner(load_engine_dir(engine_dir, verify_checksums=False), 64,
                                          options=OrtOptions(custom_kernels=kernels))
        assert all((".kernels." in f) is (path != "function-bodies")
                   for f in runners[name].graph_files.values())
    assert runners["16"].key_cache.dtype == runners["16"].value_cache.dtype == np.float16
    steps16, tokens = run_steps(runners["16"])
    greedy = [[int(i) for i in step.argmax(-1)] for step in steps16[:3]]
    steps32, tokens32 = run_steps(runners["32"])
    assert tokens32 == tokens   # the float32 engine chose the same greedy ids
    ref = reference_rows(hf, tokens)
    for step, (a, b, r) in enumerate(zip(steps16, steps32, ref)):
        if step < 3:
            assert [int(i) for i in b.argmax(-1)] == greedy[step]
        np.testing.assert_allclose(b, r, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(a, r, atol=FLOAT16_LOGITS_ATOL, rtol=0)
    assert max(np.abs(a - b).max() for a, b in zip(steps16, steps32)) > 1e-5   # the rounding is there
    # layer 0's K/V (from the embeddings alone, equal in both engines): stored rounded to nearest even
    for pool in ("key_cache", "value_cache"):
        assert np.array_equal(getattr(runners["16"], pool)[0], getattr(runners["32"], pool)[0].astype(np.float16))
    # a prompt whole, or in two chunks (the second attends the first's K/V from the pool)
    prompt = np.random.default_rng(2).integers(0, 256, 21).tolist()
    whole = runners["16"].execute(StepBatch(prefill=[ScheduledSeq(prompt, [50, 51, 52, 53, 54, 55], 0, 21, 21)]))
    chunked = runners["16-chunked"]
    chunked.execute(StepBatch(prefill=[ScheduledSeq(prompt[:9], [7, 3, 5], 0, 9)]))
    rest = chunked.execute(StepBatch(prefill=[ScheduledSeq(prompt, [7, 3, 5, 60, 61, 62], 9, 12, 12)]))
    np.testing.assert_allclose(rest, whole[9:], atol=1e-5, rtol=1e-5)


def test_float16_pools_store_values_past_their_range_saturated(tiny_model):
    """K/V past float16's range are stored as +-65504, never inf (QA 18: an inf in the pool made
    a request's logits NaN, and it generated token 0 to max_tokens); within range, rounded to
    nearest even as numpy does."""
    _, engine16 = tiny_model("llama-gqa", **FLOAT16)
    runner = OnnxRuntimeRunner(load_engine_dir(engine16, verify_checksums=False), 8)
    shape = (runner.num_layers, 3) + runner.kv_shape[3:]
    new = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    new[0, 0, 0, :3] = [1.0e5, -7.0e4, 65519.0]
    runner._store_kv(np.array([0, 5, 9]), new, -new)
    flat = runner.key_cache.reshape((runner.num_layers, -1) + runner.kv_shape[3:])
    assert flat[0, 0, 0, :3].tolist() == [65504.0, -65504.0, 65504.0]
    assert np.isfinite(runner.value_cache).all()
    np.testing.assert_array_equal(flat[:, [0, 5, 9]][:, 1:], new[:, 1:].astype(np.float16))


def pool_casts(model: onnx.ModelProto) -> int:
    """Cast nodes on what a Gather read from a pool, in the attention functions and their
    ``If`` branches."""
    def count(nodes):
        gathered = {n.output[0] for n in nodes if n.op_type == "Gather" and n.input[0] in ("key_cache", "value_cache")}
        n = sum(node.op_type == "Cast" and node.input[0] in gathered for node in nodes)
        return n + sum(count(attr.g.node) for node in nodes for attr in node.attribute
                       if attr.type == onnx.AttributeProto.GRAPH)

    return sum(count(f.node) for f in model.functions if f.name in ("PagedAttention", "PagedDecodeAttention"))


def test_float16_engine_records_the_dtype_and_halves_the_pools(tiny_model, tmp_path):
    """The manifest's ``kv_cache_dtype``, every graph's pool inputs, the runner's pools and
    bytes per block, the blocks a memory budget buys, and the manifest check."""
    _, engine16 = tiny_model("llama-gqa", **FLOAT16)
    _, engine32 = tiny_model("llama-gqa")
    e16, e32 = (load_engine_dir(e, verify_checksums=False) for e in (engine16, engine32))
    assert e16.build["kv_cache_dtype"] == "float16" and e32.build["kv_cache_dtype"] == "float32"
    for engine, elem, casts in ((e16, onnx.TensorProto.FLOAT16, True), (e32, onnx.TensorProto.FLOAT, False)):
        files = {g["file"] for g in engine.manifest["graphs"].values()}
        files |= set(engine.manifest["graph_variants"]["custom_kernels"].values())
        assert len(files) == 4
        for file in files:
            model = onnx.load(engine.file(file), load_external_data=False)
            pools = [i for i in model.graph.input if "_cache." in i.name]
            assert len(pools) == 4 and {i.type.tensor_type.elem_type for i in pools} == {elem}
            assert (pool_casts(model) > 0) is casts, file   # float32 bodies: no Cast
    r16, r32 = (OnnxRuntimeRunner(e, 8, options=OrtOptions(custom_kernels=False)) for e in (e16, e32))
    assert r16.key_cache.dtype == np.float16 and r32.key_cache.dtype == np.float32
    assert r16.kv_bytes_per_block * 2 == r32.kv_bytes_per_block == 2 * 2 * 4 * 2 * 16 * 4
    budget = 100 * r32.kv_bytes_per_block
    blocks = {name: LLM(e, kv_cache_memory_bytes=budget, verify_checksums=False).engine.kv.pool.num_blocks
              for name, e in (("16", engine16), ("32", engine32))}
    assert blocks == {"16": 200, "32": 100}
    # an engine without the key (built before the option) is float32; an unknown value is refused
    copy = tmp_path / "engine"
    shutil.copytree(engine32, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    del manifest["build"]["kv_cache_dtype"]
    (copy / "engine.json").write_text(json.dumps(manifest))
    assert load_engine_dir(str(copy)).kv_cache_dtype == "float32"
    manifest["build"]["kv_cache_dtype"] = "int8"
    (copy / "engine.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match="kv_cache_dtype 'int8'"):
        load_engine_dir(str(copy))


def test_float16_draft_engine_keeps_its_own_pools(tiny_model):
    """A float16 engine as the speculative draft of the float32 one: its own float16 pools,
    greedy output identical to the target's alone, its guesses (same weights) almost all
    accepted."""
    _, target = tiny_model("llama-gqa")
    _, draft = tiny_model("llama-gqa", **FLOAT16)
    prompts = [np.random.default_rng(3).integers(0, 256, 30).tolist()]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    base = LLM(target, num_kv_blocks=32, verify_checksums=False).generate(prompts, params)[0].outputs[0].token_ids
    llm = LLM(target, num_kv_blocks=32, verify_checksums=False, speculative_config={
        "method": "draft_model", "draft_engine": draft, "num_speculative_tokens": 3})
    assert llm.generate(prompts, params)[0].outputs[0].token_ids == base
    assert llm.engine.proposer.runner.key_cache.dtype == np.float16
    assert llm.engine.runner.key_cache.dtype == np.float32
    assert llm.engine.stats()["spec_acceptance_rate"] > 0.9


def test_bad_kv_cache_dtypes_are_refused_before_any_work(tmp_path):
    """An unknown type (argparse, the build function), and float16 for the TensorRT backends
    (their pools follow --dtype): refused before TensorRT is needed or anything is written."""
    from builder.build import BuildConfig, build_engine
    from builder.cli import add_arguments
    from builder.compile_tensorrt import ProfileLimits, compile_engine
    from trtllm_lite.runners.tensorrt_runner import TensorRTRunner

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    with pytest.raises(argparse.ArgumentError, match="--kv-cache-dtype.*'bfloat16'"):
        parser.parse_args(["--model", "m", "--output", "o", "--kv-cache-dtype", "bfloat16"])
    assert parser.parse_args(["--model", "m", "--output", "o"]).kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of float32 or float16"):
        build_engine("no-such-model", str(tmp_path / "e"), BuildConfig(kv_cache_dtype="bfloat16"))
    # (tensorrt with the default --dtype float32, which it does not build: the KV cache option is
    # the one named, QA 18; the pools follow --dtype, so float16 under bfloat16 or float32 weights
    # is refused)
    for backend, dtype in (("tensorrt", "bfloat16"), ("tensorrt", "float32"), ("tensorrt-rtx", "float32")):
        with pytest.raises(ValueError, match=f"kv_cache_dtype 'float16'.*--dtype '{dtype}'.*{backend} backend"):
            build_engine("no-such-model", str(tmp_path / "e"),
                         BuildConfig(backend=backend, dtype=dtype, kv_cache_dtype="float16"))
        with pytest.raises(ValueError, match="kv_cache_dtype 'float16'"):
            compile_engine(str(tmp_path / "e"), backend, dtype, ProfileLimits(4, 16, 64, 4), (2, 16), 2,
                           kv_cache_dtype="float16")
    assert not (tmp_path / "e").exists()
    manifest = {"build": {"backend": "tensorrt", "dtype": "bfloat16", "kv_cache_dtype": "float16",
                          "block_size": 4}, "tensorrt": {"max_num_blocks": 8}}
    with pytest.raises(ValueError, match="kv_cache_dtype 'float16' with dtype 'bfloat16'"):
        TensorRTRunner(EngineDir(str(tmp_path), manifest), 4)


def test_tensorrt_accepts_a_kv_cache_dtype_equal_to_its_dtype():
    """On TensorRT the pools hold --dtype: --kv-cache-dtype float16 with --dtype float16 says
    the same thing and passes the option checks (QA 18, L1), and its pools read as float16."""
    from builder.build import BuildConfig
    from builder.compile_tensorrt import check_kv_cache_dtype
    from trtllm_lite.runners.tensorrt_runner import TensorRTUnavailable

    for backend in ("tensorrt", "tensorrt-rtx"):
        check_kv_cache_dtype(backend, "float16", "float16")
        check_kv_cache_dtype(backend, "float32", "float16")
        try:
            BuildConfig(backend=backend, dtype="float16", kv_cache_dtype="float16").validate()
        except TensorRTUnavailable:
            pass     # (TensorRT absent: validate's last check; the KV cache and dtype checks passed)
    engine = EngineDir("/nonexistent", {"build": {"backend": "tensorrt", "dtype": "float16",
                                                  "kv_cache_dtype": "float16"}})
    assert engine.kv_pool_dtype == "float16"


_RSS_SCRIPT = """
import json, os, sys
from trtllm_lite import LLM, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
llm = LLM(sys.argv[1], num_kv_blocks=1 << 16, kv_cache_prefault=sys.argv[2] == "1")
pool = llm.engine.runner.key_cache.nbytes + llm.engine.runner.value_cache.nbytes
growth = (rss() - before) / pool
out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
print(json.dumps({"pool": pool, "growth": growth, "tokens": out[0].outputs[0].token_ids}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc/self/statm")
def test_prefault_commits_the_pool_at_start_and_lazy_pools_commit_as_used(tiny_model):
    """``kv_cache_prefault`` (the default) writes the pools while loading, so the process's RSS
    holds them before any step; with it off, loading commits almost none of the pool. Both
    engines generate the same tokens. (Each in a fresh process: in this one, glibc may hand
    a new pool memory an earlier test freed and that is still resident.)"""
    import json
    import subprocess
    import sys

    _, engine_dir = tiny_model("llama-gqa")
    runs = {}
    for prefault in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, engine_dir, prefault], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[prefault] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["1"]["pool"] > 100 << 20
    assert runs["1"]["growth"] > 0.9, runs
    assert runs["0"]["growth"] < 0.5, runs
    assert runs["1"]["tokens"] == runs["0"]["tokens"]


@pytest.mark.parametrize("where", ["engine", "runner"])
def test_a_prefaulted_pool_larger_than_the_memory_available_is_refused_at_start(tiny_model, monkeypatch, where):
    """A pool that fits the machine's RAM but not the memory available would be committed at
    start and get the process killed: refused, naming the options and their serve flags, by
    the engine before it loads anything and by the runner once the weights are in (the one
    that sees a draft pool too). The host's available memory is made small here (a real
    shortage would take this machine's memory from the rest of the suite)."""
    from trtllm_lite.core import llm_engine
    from trtllm_lite.runners import onnxruntime_runner

    _, engine_dir = tiny_model("llama-gqa")
    module = llm_engine if where == "engine" else onnxruntime_runner
    monkeypatch.setattr(module, "available_memory_bytes", lambda: 1 << 20)
    with pytest.raises(ValueError, match=r"larger than the memory available now \(1048576 bytes\).*"
                                         r"--num-kv-blocks.*--no-kv-cache-prefault"):
        LLM(engine_dir, num_kv_blocks=1 << 12)
    LLM(engine_dir, num_kv_blocks=1 << 12, kv_cache_prefault=False)    # committed as used: accepted
