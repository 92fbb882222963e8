"""The measuring tools in ``tools/`` that the docs quote figures from, on tiny engines against
HF transformers (the speed benchmarks themselves are run by hand, not here)."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import accuracy  # noqa: E402  (tools/accuracy.py)


def test_accuracy_prompt_logits_are_hf_logits_of_every_position(tiny_model):
    """``accuracy.prompt_logits``: one row per prompt position, HF's logits within float32
    rounding, and the engine left idle with every KV block back."""
    from trtllm_lite.core.llm_engine import LLMEngine

    hf, engine_dir = tiny_model("llama-gqa")
    engine = LLMEngine(engine_dir, num_threads=1, verify_checksums=False, enable_prefix_caching=False)
    ids = np.random.default_rng(3).integers(0, 256, 37).tolist()
    got = accuracy.prompt_logits(engine, ids)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    assert got.shape == want.shape == (37, 256)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert not engine.has_unfinished_requests() and engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_accuracy_compare_reports_fractions_of_the_reference_range():
    ref = {"logits": np.array([[0.0, 1.0, 4.0], [2.0, 0.0, 1.0]], np.float32), "greedy": [[1, 2], [3]]}
    got = {"logits": np.array([[0.0, 1.2, 4.0], [0.0, 1.0, 0.5]], np.float32), "greedy": [[1, 2], [4]]}
    c = accuracy.compare(ref, got)
    # row 0: 0.2 of a range of 4; row 1: 2.0 of a range of 2, and its argmax moves (0 -> 1)
    assert c["deviation_max"] == pytest.approx(1.0) and c["deviation_median"] == pytest.approx((0.05 + 1.0) / 2)
    assert c["same_argmax"] == 0.5 and c["identical_prompts"] == 1


def test_bench_engines_are_rebuilt_when_the_builder_code_changed(tiny_model, tmp_path):
    """``bench_core.ensure_engine`` keeps an engine built with the same options by the same
    builder code and rebuilds one whose manifest records another builder revision (session 35:
    engines built before ``SkipRMSNorm`` were kept, and benchmarked the old graphs)."""
    import json

    import bench_core
    from builder.build import builder_revision

    _, engine_dir = tiny_model("llama-gqa")
    hf_dir = os.path.join(os.path.dirname(engine_dir), "hf")    # (conftest: the checkpoint beside it)
    path = str(tmp_path / "engine")
    options = dict(max_seq_len=64, max_num_batched_tokens=64, max_num_seqs=4, block_size=4)
    bench_core.ensure_engine(path, hf_dir, **options)
    manifest = os.path.join(path, "engine.json")
    with open(manifest) as f:
        m = json.load(f)
    assert m["versions"]["builder"] == builder_revision()
    built_at = os.path.getmtime(manifest)
    bench_core.ensure_engine(path, hf_dir, **options)
    assert os.path.getmtime(manifest) == built_at                 # same options, same code: kept
    m["versions"]["builder"] = "0" * 16
    with open(manifest, "w") as f:
        json.dump(m, f)
    bench_core.ensure_engine(path, hf_dir, **options)
    with open(manifest) as f:
        assert json.load(f)["versions"]["builder"] == builder_revision()   # rebuilt
