"""CUDA paged-attention kernels (plugins_cu/) against the float64 numpy reference.

CPU: the sources compile with nvcc (one architecture, compile only), the ctypes binding imports
and explains why it cannot run, and its signatures match the C header.
Kernel checks, run on two backends:
  * ``gpu``: the real library (plugins_cu/build.sh) on a CUDA GPU; skipped with the reason when
    the library or a GPU is missing;
  * ``emulation``: the same kernel sources built by the host compiler against
    plugins_cu/emulation (a CPU model of threads, barriers, warp collectives, mma.sync, ldmatrix
    and cp.async), on smaller sizes; skipped when g++ or the CUDA headers are missing.
KV write, decode and (chunked) prefill on fresh random data with random block tables and ragged
lengths, GQA, MQA and MHA, block sizes 16/32/64; outputs start as NaN so every element must be
written. Relative error ||out - ref|| / ||ref|| must stay under 1e-3 in fp16 and 1e-2 in bf16.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from builder.paged_attention import reference_paged_attention, write_kv_reference
from trtllm_lite import cuda as tlcuda

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2}


# ---------------------------------------------------------------- CPU: build and binding

@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None,
                    reason="nvcc not found: CUDA sources cannot be compiled here")
def test_cuda_sources_compile(tmp_path):
    """Every .cu compiles for compute_80 (to PTX, no ptxas: the full build adds sm_80/89/90
    machine code and links; tools/device_check.sh runs it where there is a GPU)."""
    result = subprocess.run(
        ["bash", str(ROOT / "plugins_cu" / "build.sh"), "--arch", "80", "--compile-only", "--ptx-only",
         "--out", str(tmp_path), "--jobs", "2"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    objects = sorted(p.name for p in (tmp_path / "obj").glob("*.o"))
    assert objects == ["api.o", "decode_attention.o", "kv_write.o", "prefill_attention.o"]


def test_binding_signatures_match_header():
    header = (ROOT / "plugins_cu" / "include" / "trtllm_lite_kernels.h").read_text()
    header = re.sub(r"/\*.*?\*/", "", header, flags=re.S)  # drop comments
    declared = set(re.findall(r"\b(tl_[a-z0-9_]+)\s*\(", header))
    from trtllm_lite.cuda._library import _SIGNATURES
    assert declared == set(_SIGNATURES)
    for name, (_, argtypes) in _SIGNATURES.items():
        decl = re.search(rf"\b{name}\s*\(([^;]*)\);", header, re.S).group(1)
        params = [p for p in decl.split(",") if p.strip() and p.strip() != "void"]
        assert len(params) == len(argtypes), name


def test_import_without_gpu_is_harmless():
    ok, reason = tlcuda.availability()
    if not ok:
        assert reason
        with pytest.raises(tlcuda.CudaKernelsUnavailable):
            tlcuda.DeviceBuffer(16)


@pytest.mark.parametrize("call", [
    lambda: tlcuda.set_decode_kernel("bogus"),
    lambda: tlcuda.set_decode_mma_prefetch(5),
    lambda: tlcuda.set_decode_mma_prefetch(2 ** 40),
    lambda: tlcuda.set_decode_mma_prefetch("x"),
    lambda: tlcuda.set_decode_policy(min_chunk=2 ** 40),
    lambda: tlcuda.set_decode_policy(ctas_per_sm=-1),
], ids=["kernel", "prefetch-5", "prefetch-2^40", "prefetch-str", "min_chunk-2^40", "ctas-negative"])
def test_tuning_calls_reject_bad_values_before_loading_anything(call):
    """A ValueError naming the parameter, with or without the library or a GPU (never a
    silently truncated C int)."""
    with pytest.raises(ValueError, match="kernel|prefetch|min_chunk|ctas_per_sm"):
        call()


@pytest.mark.parametrize("bad,message", [
    (dict(block_tables=(1, 0, 10 ** 9)), r"block_tables\[1, 0\] = 1000000000 is outside the pool's"),
    (dict(block_tables=(2, 0, -1)), r"block_tables\[2, 0\] = -1"),
    (dict(context_lens=(1, -50)), r"context_lens must be in \[0, 144\]"),
    (dict(context_lens=(1, 10 ** 6)), r"context_lens must be in \[0, 144\]"),
    (dict(context_lens=(1, 144)), "sequence 1 reads 145 positions but its block-table row"),
    (dict(query_start_loc=(3, 7)), "query_start_loc must rise from 0 to 3 tokens"),
    (dict(context_lens=(0, 2 ** 63 - 1)), r"context_lens must be in \[0, "),   # no int64 wrap
])
def test_run_paged_attention_rejects_metadata_the_kernels_would_follow_out_of_the_pool(bad, message):
    """The kernels read block tables and lengths unchecked on the device (a GPU fault or, in
    the emulation, a crash), so the host-side runner checks them first; no library needed."""
    rng = np.random.default_rng(0)
    step = random_step(rng, [40, 100, 7], [1, 1, 1], 8, 2, 64, 16)
    for name, (i, *rest) in bad.items():
        arr = step[name]
        if rest and arr.ndim == 2:
            arr[i, rest[0]] = rest[1]
        else:
            arr[i] = rest[0]
    with pytest.raises(ValueError, match=message):
        tlcuda.run_paged_attention(**step, scale=0.125, dtype="float16", mode="auto")


def test_run_paged_attention_rejects_shapes_and_decodes_the_metadata_contradicts():
    """Tensors whose shapes disagree (the kernels size everything from query and key_cache),
    zero sequences with tokens, and a decode forced on a step whose sequences do not have one
    token each (the decode kernels would read past the block-table rows)."""
    rng = np.random.default_rng(0)
    step = random_step(rng, [40, 100, 7], [1, 1, 1], 8, 2, 64, 16)
    for name, arr in (("value_cache", step["value_cache"][:1]), ("key", step["key"][:2]),
                      ("value", step["value"][:, :, :32])):
        with pytest.raises(ValueError, match="shapes disagree"):
            tlcuda.run_paged_attention(**(step | {name: arr}), scale=0.125)
    empty = step | dict(block_tables=np.zeros((0, 2), np.int64), context_lens=np.zeros(0, np.int64),
                        query_start_loc=np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to 3 tokens"):
        tlcuda.run_paged_attention(**empty, scale=0.125)
    ragged = random_step(rng, [0, 32], [2, 0], 8, 2, 64, 16)
    for mode in ("auto", "decode"):
        with pytest.raises(ValueError, match="exactly one query token per sequence"):
            tlcuda.run_paged_attention(**ragged, scale=0.125, mode=mode, max_query_len=1)


def test_bf16_round_trip_rounds_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e-5, 65504.0], np.float32)
    bits = tlcuda.float32_to_bf16_bits(x)
    back = tlcuda.bf16_bits_to_float32(bits)
    assert back[0] == 1.0 and back[1] == 1.0 and back[2] == 1.015625 and back[3] == -2.5
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -8)


# ---------------------------------------------------------------- kernels vs reference

@dataclass
class Backend:
    name: str
    max_context: int   # longest context the random cases draw (the emulation is slower)


@pytest.fixture(scope="module", params=[pytest.param("gpu", marks=pytest.mark.gpu), "emulation"])
def backend(request):
    if request.param == "gpu":
        tlcuda.use_library(None)
        ok, reason = tlcuda.availability()
        if not ok:
            pytest.skip(f"CUDA kernels unavailable: {reason}")
        if tlcuda.build_info() == "CPU emulation":
            pytest.skip("TRTLLM_LITE_CUDA_LIB points at the emulation build")
        yield Backend("gpu", max_context=4096)
    else:
        tlcuda.use_library(request.getfixturevalue("emulated_cuda_library"))
        assert tlcuda.build_info() == "CPU emulation"
        yield Backend("emulation", max_context=600)
    tlcuda.use_library(None)


def random_step(rng, context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size):
    """Pools with the context cached, block tables over a shuffled pool, a packed step."""
    num_seqs = len(context_lens)
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(blocks_per_seq) + 5
    perm = rng.permutation(num_blocks)
    max_blocks = max(blocks_per_seq) + 2  # spare columns hold garbage ids: must never be read
    block_tables = rng.integers(10**6, 2 * 10**6, size=(num_seqs, max_blocks)).astype(np.int64)
    at = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[at:at + n]
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    num_tokens = sum(query_lens)
    slots = [block_tables[s, p // block_size] * block_size + p % block_size
             for s, (c, n) in enumerate(zip(context_lens, query_lens))
             for p in range(c, c + n)]
    return dict(query=normal(num_tokens, num_heads, head_dim),
                key=normal(num_tokens, num_kv_heads, head_dim),
                value=normal(num_tokens, num_kv_heads, head_dim),
                key_cache=normal(*shape), value_cache=normal(*shape),
                slot_mapping=np.asarray(slots, np.int64), block_tables=block_tables,
                context_lens=np.asarray(context_lens, np.int64),
                query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64))


def quantized(step, dtype):
    """The step's float tensors rounded to ``dtype`` (as float64), metadata unchanged."""
    out = dict(step)
    for name in ("query", "key", "value", "key_cache", "value_cache"):
        out[name] = tlcuda.from_device_dtype(
            tlcuda.to_device_dtype(step[name], dtype), dtype).astype(np.float64)
    return out


def check_against_reference(step, dtype, mode, **bounds):
    head_dim = step["query"].shape[2]
    scale = head_dim ** -0.5
    q = quantized(step, dtype)
    ref = reference_paged_attention(q["query"], q["key"], q["value"], q["key_cache"],
                                    q["value_cache"], q["block_tables"], q["context_lens"],
                                    q["query_start_loc"], scale)
    res = tlcuda.run_paged_attention(**step, scale=scale, dtype=dtype, mode=mode, **bounds)
    assert np.isfinite(res.output).all(), "some output elements were not written"
    err = np.linalg.norm(res.output - ref) / np.linalg.norm(ref)
    assert err < TOLERANCE[dtype], f"{mode} {dtype}: relative error {err:.2e}"
    k_ref, v_ref = q["key_cache"].copy(), q["value_cache"].copy()
    write_kv_reference(k_ref, v_ref, q["key"], q["value"], step["slot_mapping"])
    np.testing.assert_array_equal(res.key_cache, k_ref)   # the write is an exact copy
    np.testing.assert_array_equal(res.value_cache, v_ref)
    return err


DTYPES = ["float16", "bfloat16"]
# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2-like GQA, Llama-like GQA, MHA, MQA.
HEADS = [(9, 3, 64, 16), (32, 8, 128, 64), (8, 8, 128, 16), (16, 1, 64, 32), (4, 4, 64, 64)]


def use_decode_kernel(name):
    """"pipelined", "registers", "mma" (its default prefetch choice), "mma+prefetch" or
    "mma+direct" (prefetch forced on / off)."""
    kernel, _, option = name.partition("+")
    tlcuda.set_decode_kernel(kernel)
    tlcuda.set_decode_mma_prefetch({"prefetch": 1, "direct": 0}.get(option, -1))


def restore_decode_defaults():
    tlcuda.set_decode_policy()
    tlcuda.set_decode_kernel()
    tlcuda.set_decode_mma_prefetch()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}kv{}d{}b{}".format(*h))
@pytest.mark.parametrize("split", ["split", "nosplit"])
@pytest.mark.parametrize("kernel", ["mma", "mma+prefetch", "mma+direct", "pipelined",
                                    "registers"])
def test_decode_matches_reference(backend, kernel, dtype, heads, split):
    rng = np.random.default_rng()
    num_heads, num_kv_heads, head_dim, block_size = heads
    longest = backend.max_context
    context_lens = [int(c) for c in rng.integers(0, longest // 2, size=5)] + [0, 1, 15, longest]
    step = random_step(rng, context_lens, [1] * len(context_lens), num_heads, num_kv_heads,
                       head_dim, block_size)
    tlcuda.set_decode_policy(min_chunk=1 << 24 if split == "nosplit" else 0)
    use_decode_kernel(kernel)
    try:
        max_len = max(context_lens) + 1
        splits = tlcuda.decode_num_splits(len(context_lens), num_heads, num_kv_heads, head_dim,
                                          max_len)
        assert (splits == 1) == (split == "nosplit")
        check_against_reference(step, dtype, "decode")
    finally:
        restore_decode_defaults()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}kv{}d{}b{}".format(*h))
def test_prefill_matches_reference(backend, dtype, heads):
    """Fresh prompts (no context) with ragged lengths, one of them a single token."""
    rng = np.random.default_rng()
    num_heads, num_kv_heads, head_dim, block_size = heads
    query_lens = [int(n) for n in rng.integers(2, backend.max_context // 16, size=3)] + [1, 67]
    step = random_step(rng, [0] * len(query_lens), query_lens, num_heads, num_kv_heads,
                       head_dim, block_size)
    check_against_reference(step, dtype, "prefill")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}kv{}d{}b{}".format(*h))
def test_chunked_prefill_with_context_matches_reference(backend, dtype, heads):
    """Chunks after a cached context, mixed with decode tokens, through the op's own dispatch."""
    rng = np.random.default_rng()
    num_heads, num_kv_heads, head_dim, block_size = heads
    context_lens = [int(c) for c in rng.integers(1, backend.max_context // 4, size=4)]
    context_lens += [block_size, 0]
    query_lens = [int(n) for n in rng.integers(1, backend.max_context // 32, size=4)] + [1, 33]
    step = random_step(rng, context_lens, query_lens, num_heads, num_kv_heads, head_dim,
                       block_size)
    check_against_reference(step, dtype, "auto")


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_dispatch_decode_batch(backend, dtype):
    """All query lengths 1 through tl_paged_attention: the decode kernel path, GQA."""
    rng = np.random.default_rng()
    context_lens = [int(c) for c in rng.integers(0, backend.max_context // 2, size=7)]
    step = random_step(rng, context_lens, [1] * 7, 12, 4, 128, 16)
    check_against_reference(step, dtype, "auto")


@pytest.mark.parametrize("mode", ["decode-mma+prefetch", "decode-mma+direct", "decode-pipelined",
                                  "decode-registers", "prefill"])
def test_understated_bounds_stay_correct(backend, mode):
    """max_seq_len / max_query_len only size the grids: too small must not drop positions."""
    rng = np.random.default_rng()
    mode, _, kernel = mode.partition("-")
    n = 1 if mode == "decode" else 90
    context_lens = [int(c) for c in rng.integers(300, backend.max_context, size=3)]
    step = random_step(rng, context_lens, [n] * 3, 8, 2, 64, 16)
    use_decode_kernel(kernel or "mma")
    try:
        # decode: 3 splits of 256 planned for positions < 600, the last one must take the rest
        check_against_reference(step, "float16", mode, max_query_len=n if n == 1 else 10,
                                max_seq_len=600)
    finally:
        restore_decode_defaults()


def test_kv_write_skips_negative_slots_and_leaves_the_rest(backend):
    rng = np.random.default_rng()
    step = random_step(rng, [5, 40], [3, 2], 4, 2, 64, 16)
    step["slot_mapping"][1] = -1
    before = tlcuda.from_device_dtype(tlcuda.to_device_dtype(step["key_cache"], "float16"),
                                      "float16")
    res = tlcuda.run_paged_attention(**step, scale=0.125, dtype="float16", mode="prefill")
    expect = before.copy()
    keep = step["slot_mapping"] >= 0
    flat = expect.reshape(-1, 2, 64)
    flat[step["slot_mapping"][keep]] = np.asarray(step["key"][keep], np.float16)
    np.testing.assert_array_equal(res.key_cache, expect)
