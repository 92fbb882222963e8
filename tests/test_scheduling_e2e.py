"""Chunked prefill, prefix caching and preemption on the real SmolLM2 engine: greedy ids
never change, and the block invariants hold after every step."""
from collections import Counter

import numpy as np
import pytest

from trtllm_lite import SamplingParams
from trtllm_lite.core.kv_cache_manager import KVCacheManager
from trtllm_lite.core.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def configure(smollm2_llm):
    """Swap in a scheduler / KV manager with the given limits over the same runner."""
    engine = smollm2_llm.engine
    saved = engine.kv, engine.scheduler, engine.scheduler_config

    def apply(num_blocks=512, enable_prefix_caching=False, **config):
        cfg = SchedulerConfig(**{"max_num_seqs": 32, "max_seq_len": 1024,
                                 "max_num_batched_tokens": 1024, **config})
        engine.kv = KVCacheManager(num_blocks, engine.block_size, enable_prefix_caching)
        engine.scheduler = Scheduler(cfg, engine.kv)
        engine.scheduler_config = cfg
        return engine

    yield apply
    engine.kv, engine.scheduler, engine.scheduler_config = saved
    # the swapped-in managers wrote into the same runner pool: the restored manager's cached
    # blocks no longer hold what their hashes say
    engine.kv.pool.reset_prefix_cache()


def check_invariants(engine):
    pool = engine.kv.pool
    pool.check()
    tables = [s.block_table for s in engine.scheduler.running + list(engine.scheduler.waiting)]
    refs = Counter(b for t in tables for b in t)
    for block, count in refs.items():
        assert pool.ref_counts[block] == count, "ref count != table references"
        if count > 1:
            assert pool.block_hashes[block] is not None, "block in two tables but not prefix-shared"
    assert pool.num_used == len(refs)


def run(engine, prompts, params=GREEDY, arrive_at=None, salts=None):
    """Add prompts at the given steps, step to the end checking invariants; return ids."""
    arrive_at = arrive_at or [0] * len(prompts)
    ids, out, step = {}, {}, 0
    pending = sorted(range(len(prompts)), key=lambda i: arrive_at[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrive_at[pending[0]] <= step:
            i = pending.pop(0)
            ids[engine.add_request(prompts[i], params, cache_salt=(salts or [None] * len(prompts))[i])] = i
        for o in engine.step():
            out.setdefault(ids[o.request_id], []).extend(o.outputs[0].token_ids)
            if o.finished:
                out[("cached", ids[o.request_id])] = o.num_cached_tokens
        check_invariants(engine)
        step += 1
        assert step < 2000
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    return [out[i] for i in range(len(prompts))], [out[("cached", i)] for i in range(len(prompts))]


def token_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(200, 30000, n).tolist() for n in lengths]


def test_chunked_prefill_never_changes_outputs(configure):
    prompts = token_prompts([1, 17, 60, 150, 300, 33])
    arrive = [0, 0, 2, 3, 3, 6]                     # long prompts arrive among running decodes
    engine = configure(enable_chunked_prefill=False)
    reference, _ = run(engine, prompts, arrive_at=arrive)
    for budget in (13, 17, 31, 64):
        engine = configure(max_num_batched_tokens=budget)
        chunked, _ = run(engine, prompts, arrive_at=arrive)
        assert chunked == reference, f"budget {budget}"


def test_decodes_run_between_chunks(configure):
    engine = configure(max_num_batched_tokens=32)
    short, long_ = token_prompts([5, 200])
    engine.add_request(short, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request(long_, GREEDY)
    for _ in range(4):
        out = engine.scheduler.schedule()
        assert len(out.batch.decode) == 1 and out.batch.prefill[0].num_new_tokens == 31
        engine.runner.execute(out.batch)
        for seq, item in zip(out.seqs, out.batch.decode + out.batch.prefill):
            seq.num_computed_tokens += item.num_new_tokens
            if item.samples:
                seq.token_ids.append(0)
    for rid in list(engine.requests):
        engine.abort(rid)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_prefix_caching_never_changes_outputs(configure):
    b = 16
    warm = token_prompts([100], seed=1)[0]
    batch = [warm + token_prompts([20], seed=2)[0], token_prompts([70], seed=3)[0], warm]
    edge = [token_prompts([k * b - 1], seed=4)[0], token_prompts([k * b], seed=5)[0],
            token_prompts([k * b + 1], seed=6)[0]] if (k := 5) else []
    twins = token_prompts([90], seed=7) * 2

    engine = configure(enable_prefix_caching=False)
    ref_batch, _ = run(engine, batch)
    ref_edge, _ = run(engine, edge)
    ref_twins, _ = run(engine, twins)

    engine = configure(enable_prefix_caching=True)
    run(engine, [warm])
    got, cached = run(engine, batch)
    assert got == ref_batch
    assert cached[0] == 96 and cached[1] == 0 and cached[2] == 96   # warm prompt: last token recomputed
    for twice in range(2):
        got, cached = run(engine, edge)
        assert got == ref_edge
        if twice:
            assert cached == [4 * b, 4 * b, 5 * b]
    got, _ = run(engine, twins)
    assert got == ref_twins
    assert engine.stats()["prefix_hit_rate"] > 0.3


def test_cache_salt_isolates_tenants(configure):
    engine = configure(enable_prefix_caching=True)
    prompt = token_prompts([64], seed=9)
    _, cached_a = run(engine, prompt, salts=["tenant-a"])
    _, cached_b = run(engine, prompt, salts=["tenant-b"])
    _, cached_a2 = run(engine, prompt, salts=["tenant-a"])
    assert cached_a == [0] and cached_b == [0] and cached_a2 == [48]


def test_preemption_keeps_outputs_and_frees_everything(configure):
    prompts = token_prompts([40, 35, 50, 45, 30, 42], seed=11)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = configure(num_blocks=512)
    reference, _ = run(engine, prompts, params)
    engine = configure(num_blocks=16)     # 256 slots for six sequences of ~80 tokens
    got, _ = run(engine, prompts, params)
    assert got == reference
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("num_blocks", [512, 12])     # 12: preemption too
def test_n_greater_than_1_never_runs_more_than_max_num_seqs(configure, num_blocks):
    """A request of n > 1 forks its other sequences after its prompt: the forks were appended
    past the cap (QA: 4 requests of n = 4 ran 16 sequences a step at max_num_seqs 4), which
    TensorRT's decode profile (1..max_num_seqs) cannot take. Outputs equal a roomy run's."""
    prompts = token_prompts([6, 9, 5, 7], seed=3)
    params = [SamplingParams(n=4, max_tokens=6, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]

    def run_n(engine, cap):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(p, sp, f"r{i}")
        ids = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for o in out.outputs:
                    ids.setdefault((out.request_id, o.index), []).extend(o.token_ids)
            assert len(engine.scheduler.running) <= cap
            engine.kv.pool.check()       # (forks share blocks unhashed: check_invariants' rule is for prompts)
        assert engine.kv.pool.num_used == 0
        return ids

    reference = run_n(configure(max_num_seqs=32), 32)
    assert run_n(configure(num_blocks=num_blocks, max_num_seqs=4), 4) == reference


def test_prompt_larger_than_pool_is_refused(configure):
    engine = configure(num_blocks=4)
    with pytest.raises(ValueError, match="whole pool"):
        engine.add_request(token_prompts([60])[0], GREEDY)


def test_cpu_token_budget_default_and_overrides(smollm2_llm, smollm2_engine):
    """The CPU backend's budget defaults to 512 for serving (engine built with 1024): a
    700-token prompt takes two prefill steps; the offline ``LLM`` takes 1024 (its cap, here
    also the build value), and so does an engine without chunked prefill: one step."""
    from trtllm_lite.core.llm_engine import (CPU_MAX_NUM_BATCHED_TOKENS, CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS,
                                             LLMEngine)

    offline = smollm2_llm.engine
    assert offline.engine.build["max_num_batched_tokens"] == 1024 == CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert offline.scheduler_config.max_num_batched_tokens == 1024
    prompt = list(np.random.default_rng(7).integers(1000, 40000, 700))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def steps_to_finish(e):
        e.add_request(prompt, params)
        steps = 0
        while e.has_unfinished_requests():
            e.step()
            steps += 1
        assert e.kv.pool.num_used == 0
        return steps

    assert steps_to_finish(offline) == 1
    serving = LLMEngine(smollm2_engine, num_kv_blocks=64, verify_checksums=False, enable_prefix_caching=False)
    assert serving.scheduler_config.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS == 512
    assert steps_to_finish(serving) == 2
    del serving
    whole = LLMEngine(smollm2_engine, num_kv_blocks=64, verify_checksums=False,
                      enable_chunked_prefill=False, enable_prefix_caching=False)
    assert whole.scheduler_config.max_num_batched_tokens == 1024
    assert steps_to_finish(whole) == 1


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "max_seq_len"])
@pytest.mark.parametrize("value", [0, -1, 10**9, "512", 2.5, 512.0, True])
def test_engine_limits_must_be_integers_in_range(smollm2_engine, name, value):
    """A limit that is not an integer in [1, build value] (str, float, bool, out of range)
    is refused at construction with a ValueError naming it (found by QA: "512" was a
    TypeError inside a comparison, 1.5 was accepted and failed at the first step)."""
    from trtllm_lite.core.llm_engine import LLMEngine

    with pytest.raises(ValueError, match=name):
        LLMEngine(smollm2_engine, num_kv_blocks=8, verify_checksums=False, **{name: value})


@pytest.mark.parametrize("chunked", [True, False])
def test_token_budget_below_max_num_seqs_is_refused(smollm2_engine, chunked):
    """A step must hold one token of every running sequence: max_num_batched_tokens below
    max_num_seqs is a ValueError naming both values, as in vLLM (it was accepted silently)."""
    from trtllm_lite.core.llm_engine import LLMEngine

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(7\) must be greater than or equal to "
                                         r"max_num_seqs \(8\)"):
        LLMEngine(smollm2_engine, num_kv_blocks=8, verify_checksums=False, enable_chunked_prefill=chunked,
                  max_num_seqs=8, max_num_batched_tokens=7)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) .* max_num_seqs \(32\)"):
        LLMEngine(smollm2_engine, num_kv_blocks=8, verify_checksums=False, enable_chunked_prefill=chunked,
                  max_num_batched_tokens=16)      # max_num_seqs: the build value, 32
    equal = LLMEngine(smollm2_engine, num_kv_blocks=8, verify_checksums=False, enable_chunked_prefill=chunked,
                      max_num_seqs=8, max_num_batched_tokens=8)
    assert (equal.scheduler_config.max_num_seqs, equal.scheduler_config.max_num_batched_tokens) == (8, 8)


def test_engine_limits_take_numpy_integers(smollm2_engine):
    """Integers from numpy (a config array) are integers: kept, as Python ints."""
    from trtllm_lite.core.llm_engine import LLMEngine

    engine = LLMEngine(smollm2_engine, num_kv_blocks=8, verify_checksums=False, max_num_seqs=np.int64(4))
    assert engine.scheduler_config.max_num_seqs == 4 and type(engine.scheduler_config.max_num_seqs) is int
