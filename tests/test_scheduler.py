"""Scheduler and KV block invariants on CPU, no model: small helpers, invariants every step."""
import numpy as np
import pytest

from trtllm_lite.core.kv_cache_manager import KVCacheManager
from trtllm_lite.core.scheduler import Scheduler, SchedulerConfig
from trtllm_lite.core.sequence import Sequence, SequenceStatus
from trtllm_lite.sampling_params import SamplingParams


def create_scheduler(num_blocks=64, block_size=4, **config):
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size))


def create_requests(lengths, max_tokens=8):
    return [Sequence(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))
            for i, n in enumerate(lengths)]


def run_step(sched: Scheduler, finish_after=None):
    """Schedule, pretend the model ran (append token 0 where sampled), check invariants."""
    out = sched.schedule()
    for seq, item in zip(out.seqs, out.batch.decode + out.batch.prefill):
        assert seq.num_computed_tokens == item.start
        seq.num_computed_tokens += item.num_new_tokens
        if item.samples:
            seq.token_ids.append(0)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    check_invariants(sched)
    return out


def check_invariants(sched: Scheduler):
    sched.kv.pool.check()
    used = [b for s in sched.running for b in s.block_table]
    assert len(used) == len(set(used)), "a block in two block tables"
    assert len(used) == sched.kv.pool.num_used
    for s in sched.running:
        assert len(s.block_table) * sched.kv.block_size >= s.num_computed_tokens


def test_budget_and_max_num_seqs_are_respected():
    sched = create_scheduler(max_num_seqs=3, max_num_batched_tokens=20)
    for seq in create_requests([5, 5, 5, 5]):
        sched.add(seq)
    out = run_step(sched)
    assert len(out.seqs) == 3 and out.batch.num_tokens == 15


def test_decodes_first_then_chunks_and_finished_leave():
    sched = create_scheduler(max_num_batched_tokens=8)
    a, b = create_requests([3, 20], max_tokens=4)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    out = run_step(sched)
    assert out.batch.decode[0].token_ids is a.token_ids  # a's decode comes first
    assert out.batch.prefill[0].num_new_tokens == 7      # b's chunk gets the rest of the budget
    while sched.has_unfinished():
        run_step(sched)
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_preemption_by_recompute_when_pool_runs_dry():
    sched = create_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    old, new = create_requests([8, 8], max_tokens=12)
    sched.add(old)
    sched.add(new)
    steps = 0
    while sched.has_unfinished():
        run_step(sched)
        steps += 1
        assert steps < 200
    assert sched.num_preemptions > 0
    assert new.num_preemptions > 0 and old.num_preemptions == 0  # the newest gives way
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert sched.kv.pool.num_free == 6


def test_max_waiting_counts_new_requests_not_preempted_sequences():
    """QA: a preempted sequence back in the queue counted against ``max_waiting``, so an
    engine running one request refused the next one."""
    sched = create_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_waiting=1)
    old, new, late, later = create_requests([8, 8, 3, 3], max_tokens=12)
    sched.add(old)
    run_step(sched)
    sched.add(new)
    while not new.num_preemptions:
        run_step(sched)
    assert list(sched.waiting) == [new] and sched.num_preempted_waiting == 1
    sched.add(late)                      # one new request may wait beside the preempted one
    with pytest.raises(OverflowError, match="waiting queue is full"):
        sched.add(later)
    while sched.has_unfinished():
        run_step(sched)
    assert sched.num_preempted_waiting == 0 and sched.kv.pool.num_free == 6


def test_request_that_never_fits_is_refused_at_admission():
    sched = create_scheduler(num_blocks=4, block_size=4, max_seq_len=100)
    with pytest.raises(ValueError, match="whole pool"):
        sched.add(create_requests([10], max_tokens=10)[0])
    with pytest.raises(ValueError, match="whole pool"):     # the pool (16 tokens) binds, not max_seq_len
        sched.add(create_requests([90], max_tokens=20)[0])
    with pytest.raises(ValueError, match="max_seq_len"):
        create_scheduler(num_blocks=64, block_size=4, max_seq_len=100).add(create_requests([90], max_tokens=20)[0])


def test_check_room_is_admission_check_naming_the_field_sent():
    """One check serves admission and the HTTP chat route's ``max_completion_tokens``: the
    room after the prompt is the smaller of max_seq_len and the pool (16 tokens here)."""
    sched = create_scheduler(num_blocks=4, block_size=4, max_seq_len=20)
    sched.check_room(10, 6)                                             # 16 tokens: 4 blocks
    with pytest.raises(ValueError, match=r"^max_completion_tokens \+ prompt = 17 tokens .* whole pool"):
        sched.check_room(10, 7, "max_completion_tokens")
    # past both limits: the smaller (the pool) is named (QA: "exceeds max_seq_len" past a smaller pool)
    with pytest.raises(ValueError, match=r"^max_completion_tokens \+ prompt = 21 tokens .* whole pool"):
        sched.check_room(10, 11, "max_completion_tokens")
    with pytest.raises(ValueError, match=r"^max_completion_tokens \(11\) \+ prompt \(10 tokens\) = 21 "
                                         r"exceeds max_seq_len 20"):
        create_scheduler(num_blocks=8, block_size=4, max_seq_len=20).check_room(10, 11, "max_completion_tokens")
    with pytest.raises(ValueError, match=r"^max_tokens \+ prompt = 17 tokens"):
        sched.add(create_requests([10], max_tokens=7)[0])              # admission: the same check


def test_prompt_without_room_for_output_is_named_as_the_cause():
    """A prompt that alone fills max_seq_len or the pool is refused naming the prompt and the
    limit, not max_tokens: the HTTP chat route fills max_tokens in when a client sends none, and
    such a 400 said 'max_tokens + prompt = ...' with param max_tokens (QA)."""
    sched = create_scheduler(num_blocks=4, block_size=4, max_seq_len=20)   # the pool: 16 tokens
    sched.check_room(15, 1)
    with pytest.raises(ValueError, match=r"^prompt \(16 tokens\) leaves no room for output: the whole pool "
                                         r"holds 16 tokens \(4 x 4 tokens\)"):
        sched.check_room(16, 1, "max_completion_tokens")
    with pytest.raises(ValueError, match=r"^prompt \(20 tokens\) leaves no room for output: it reaches "
                                         r"max_seq_len 20"):
        create_scheduler(num_blocks=8, block_size=4, max_seq_len=20).add(create_requests([20], max_tokens=1)[0])


def test_finish_is_idempotent_and_frees_waiting_or_running():
    sched = create_scheduler()
    a, b = create_requests([5, 5])
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    sched.finish(a, "abort")
    assert a.status is SequenceStatus.FINISHED and not sched.has_unfinished()
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_block_pool_reuses_freed_blocks_before_fresh_and_evicts_cached_last():
    """Allocation order: freed uncached blocks, then never-used blocks, then cached blocks
    least-recently-freed first; so a CPU pool is touched only as far as the peak load needs,
    and cached prefixes live while anything else is free."""
    from trtllm_lite.core.block_pool import BlockPool

    pool = BlockPool(8)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    pool.free(a)
    assert sorted(pool.allocate(3)) == [0, 1, 2]          # reused, blocks 3-7 still untouched
    pool.register(1, b"h1")
    pool.register(2, b"h2")
    pool.free([0, 1, 2])
    pool.check()
    assert pool.allocate(1) == [0]                         # the uncached one
    assert pool.allocate(5) == [3, 4, 5, 6, 7]             # then fresh ones; 1 and 2 stay cached
    assert pool.lookup(b"h1") == 1 and pool.num_evictions == 0
    pool.touch([2])                                        # a prefix hit takes a cached block back
    assert pool.allocate(1) == [1] and pool.lookup(b"h1") is None and pool.num_evictions == 1
    pool.check()
    assert pool.num_free == 0
    with pytest.raises(RuntimeError, match="free"):
        pool.allocate(1)


def test_block_pool_refuses_double_free_and_touching_unallocated_blocks():
    """Misuse raises before changing anything (found by QA: a double free left a -1 count)."""
    from trtllm_lite.core.block_pool import BlockPool

    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(a)
    with pytest.raises(RuntimeError, match="never allocated"):
        pool.touch([3])
    pool.check()
    b = pool.allocate(2)                      # a list with good blocks before the bad one
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([b[0], b[1], b[1]])
    assert list(pool.ref_counts[b]) == [1, 1] and pool.num_free == 2
    with pytest.raises(RuntimeError, match="never allocated"):
        pool.touch([b[0], 3])
    assert list(pool.ref_counts[b]) == [1, 1]
    pool.free(b)
    pool.check()


def test_cached_tokens_count_the_first_admissions_prompt_hit_only():
    """A sequence preempted after generating finds its prompt's and its own output's blocks in
    the prefix cache when readmitted; its ``num_cached_tokens`` (the usage's cached_tokens)
    stays what its first admission found, prompt tokens only (QA saw 336 of a 300-token prompt)."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    warm = Sequence("warm", list(range(10, 22)), SamplingParams(max_tokens=8))   # 3 full blocks cached
    assert kv.allocate_slots(warm, 12)
    warm.num_computed_tokens = 12
    kv.cache_full_blocks(warm)
    kv.free(warm)

    seq = Sequence("r", list(range(10, 22)) + [99], SamplingParams(max_tokens=8))   # warm's prompt + 1
    computed = kv.get_computed_blocks(seq)
    assert len(computed) == 3 and kv.allocate_slots(seq, 1, computed)
    assert seq.num_cached_tokens == 12
    for t in range(100, 108):                       # 8 output tokens: two more full blocks
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(t)
        assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens = seq.num_tokens - 1
    kv.cache_full_blocks(seq)
    kv.free(seq)                                    # preempted by recompute
    seq.block_table, seq.num_computed_tokens, seq.num_registered_blocks = [], 0, 0
    seq.num_preemptions += 1
    computed = kv.get_computed_blocks(seq)
    assert len(computed) == 5                       # prompt and output blocks found again
    assert kv.allocate_slots(seq, seq.num_tokens - 20, computed)
    assert seq.num_cached_tokens == 12 <= seq.num_prompt_tokens


def test_step_inputs_match_their_definition_for_decode_and_mixed_steps():
    """build_step_inputs (its all-decode shortcut and the general packing) against the inputs'
    definition written out token by token: position = start + j, slot = block_table[position //
    block_size] * block_size + position % block_size, the sequence's token at that position,
    query_start_loc the running sum of query lengths, logits rows the sequences' last tokens."""
    from trtllm_lite.runners.base import ScheduledSeq, build_step_inputs

    rng = np.random.default_rng(0)
    for trial in range(200):
        block_size = int(rng.choice([1, 3, 16]))
        seqs = []
        for _ in range(int(rng.integers(1, 9))):
            start = int(rng.integers(0, 60))
            q = 1 if trial % 2 == 0 else int(rng.integers(1, 20))    # even trials: decodes only
            unfinished = int(rng.integers(0, 3)) if trial % 4 >= 2 else 0   # a chunk that samples nothing
            tokens = rng.integers(0, 1000, start + q + unfinished).tolist()
            blocks = rng.permutation(200)[:-(-(start + q) // block_size)].tolist()
            seqs.append(ScheduledSeq(tokens, blocks, start, q))
        got = build_step_inputs(seqs, block_size)
        ids, pos, slots, logits = [], [], [], []
        for s in seqs:
            for j in range(s.num_new_tokens):
                p = s.start + j
                ids.append(s.token_ids[p])
                pos.append(p)
                slots.append(s.block_table[p // block_size] * block_size + p % block_size)
            logits.extend(range(len(ids) - s.num_logits, len(ids)))
        qsl = np.concatenate([[0], np.cumsum([s.num_new_tokens for s in seqs])])
        for name, want in (("input_ids", ids), ("positions", pos), ("slot_mapping", slots),
                           ("context_lens", [s.start for s in seqs]), ("query_start_loc", qsl),
                           ("logits_indices", logits)):
            value = getattr(got, name)
            assert value.dtype == np.int64, name
            np.testing.assert_array_equal(value, want, err_msg=f"{name}, trial {trial}")
        for i, s in enumerate(seqs):
            np.testing.assert_array_equal(got.block_tables[i, :len(s.block_table)], s.block_table)
            assert not got.block_tables[i, len(s.block_table):].any()
