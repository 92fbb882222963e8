"""Speculative decoding never changes what a request produces."""
import numpy as np
import pytest

from trtllm_lite import LLM, SamplingParams

PARAGRAPH = ("The quick brown fox jumps over the lazy dog. The dog was not amused, and it barked loudly "
             "at the fox, who ran away into the forest where it found a small river.")
GROUNDED = [{"role": "user", "content": "Repeat this paragraph exactly:\n" + PARAGRAPH}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def spec_llm(smollm2_engine):
    llm = LLM(smollm2_engine, num_kv_blocks=256, verify_checksums=False, max_num_batched_tokens=64,
              speculative_config=NGRAM)
    yield llm
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def grounded_ids(llm):
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template(GROUNDED), add_special_tokens=False)


def test_ngram_greedy_identical_alone_and_mixed(smollm2_llm, spec_llm):
    prompts = [grounded_ids(smollm2_llm), "Tell me about the moon.",
               np.random.default_rng(0).integers(200, 30000, 150).tolist()]     # chunked with budget 64
    params = SamplingParams(max_tokens=48, temperature=0)
    base = [o.outputs[0] for o in smollm2_llm.generate(prompts, params)]
    alone = spec_llm.generate(prompts[:1], params)[0].outputs[0]
    mixed = [o.outputs[0] for o in spec_llm.generate(prompts, params)]
    assert alone.token_ids == base[0].token_ids and alone.text == base[0].text
    assert [c.token_ids for c in mixed] == [c.token_ids for c in base]
    assert [c.finish_reason for c in mixed] == [c.finish_reason for c in base]
    stats = spec_llm.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 10 and stats["spec_mean_accepted_length"] > 1.5


@pytest.mark.parametrize("case", ["stop_string", "stop_token", "max_tokens", "eos"])
def test_stop_conditions_inside_an_accepted_burst(smollm2_llm, spec_llm, case):
    prompt = grounded_ids(smollm2_llm)
    ref = smollm2_llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0))[0].outputs[0]
    kw = dict(max_tokens=60, temperature=0)
    if case == "stop_string":
        kw["stop"] = ["barked"]
    elif case == "stop_token":
        kw["stop_token_ids"] = [ref.token_ids[13]]
    elif case == "max_tokens":
        kw["max_tokens"] = 13
    params = SamplingParams(**kw)
    want = smollm2_llm.generate([prompt], params)[0].outputs[0]
    got = spec_llm.generate([prompt], params)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
           (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    if case == "eos":
        assert got.finish_reason == "stop" and got.token_ids[-1] == 2


def test_seeded_sampling_identical_with_and_without_speculation(smollm2_llm, spec_llm):
    prompt = grounded_ids(smollm2_llm)
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=42, logprobs=2)
    a = spec_llm.generate([prompt], params)[0].outputs[0]
    b = spec_llm.generate([prompt], params)[0].outputs[0]
    c = smollm2_llm.generate([prompt], params)[0].outputs[0]
    assert a.token_ids == b.token_ids == c.token_ids
    assert [sorted(x) for x in a.logprobs] == [sorted(x) for x in c.logprobs]


def test_n_samples_all_start_after_the_prompt_when_its_last_chunk_carried_drafts(smollm2_engine, smollm2_llm,
                                                                                 spec_llm):
    """A prompt whose last prefill chunk is one token is proposed drafts with that chunk; the
    n samples must all start from the logits after the prompt, as without speculation (QA 25:
    samples 2..n took the last draft's row), and a block past the prompt's that holds drafts
    must not be shared with the other samples (they would write their own tokens into it)."""
    ids = grounded_ids(smollm2_llm) * 3
    # 129 tokens at spec_llm's budget of 64: chunks of 64, 64 and 1, drafts in the prompt's last
    # block; 157 at a budget of 13: twelve chunks of 13, then 1 at position 156, whose drafts
    # (157-160) reach into the next block
    small_budget = LLM(smollm2_engine, num_kv_blocks=256, verify_checksums=False, max_num_seqs=8,
                       max_num_batched_tokens=13, enable_prefix_caching=False,   # (every run chunked)
                       speculative_config=NGRAM)
    for llm, prompt in ((spec_llm, ids[:129]), (small_budget, ids[:157])):
        for params in (SamplingParams(max_tokens=16, temperature=0, n=2),
                       SamplingParams(max_tokens=16, temperature=0.8, seed=7, n=3)):
            want = [c.token_ids for c in smollm2_llm.generate([prompt], params)[0].outputs]
            got = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
            assert got == want, (len(prompt), params)
        assert llm.engine.stats()["spec_num_drafts"] > 0
    # after every step no sequence shares a block past its computed tokens (its next writes
    # go there); the fork once shared the parent's draft block with the children
    engine = small_budget.engine
    engine.add_request(ids[:157], SamplingParams(max_tokens=12, temperature=0, n=2))
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            ahead = seq.block_table[-(-seq.num_computed_tokens // engine.block_size):]
            assert all(engine.kv.pool.ref_counts[block] == 1 for block in ahead), seq.index
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_draft_model_proposer_greedy_identical_and_frees_blocks(tiny_model, tmp_path):
    from builder.build import BuildConfig, build_engine
    from tests.conftest import make_tiny_hf

    _, engine_dir = tiny_model("llama-gqa")
    draft_dir = build_engine(make_tiny_hf("llama-gqa", str(tmp_path / "hf")), str(tmp_path / "draft"),
                             BuildConfig(max_seq_len=256, max_num_batched_tokens=256, max_num_seqs=16,
                                         block_size=4, draft_layers=1))
    rng = np.random.default_rng(3)
    pattern = rng.integers(0, 256, 6).tolist()
    prompts = [pattern * 4, rng.integers(0, 256, 30).tolist(), pattern * 2 + [7, 7]]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(engine_dir, num_kv_blocks=64).generate(prompts, params)]
    for draft in (engine_dir, draft_dir):          # the target itself (accepts all) and its first layer
        llm = LLM(engine_dir, num_kv_blocks=64, speculative_config={
            "method": "draft_model", "draft_engine": draft, "num_speculative_tokens": 3})
        assert [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts] == base
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == base
        proposer = llm.engine.proposer
        assert proposer.kv.pool.num_free == proposer.kv.pool.num_blocks      # draft blocks back
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks  # target blocks back
        if draft == engine_dir:
            assert llm.engine.stats()["spec_acceptance_rate"] > 0.9
    # a pool that preempts: outputs the same, and a preempted sequence keeps no draft blocks
    # while it waits (QA: held until its request ended)
    from trtllm_lite.core.sequence import SequenceStatus

    engine = LLM(engine_dir, num_kv_blocks=14, speculative_config={
        "method": "draft_model", "draft_engine": draft_dir, "num_speculative_tokens": 3}).engine
    ids = [engine.add_request(p, params) for p in prompts]
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        states = engine.proposer.states
        assert not [s for s in states if s.status is SequenceStatus.WAITING and states[s].block_table]
    assert engine.scheduler.num_preemptions > 0
    assert [got[i] for i in ids] == base
    assert engine.proposer.kv.pool.num_free == engine.proposer.kv.pool.num_blocks


def test_a_draft_with_a_shorter_max_seq_len_stops_proposing_at_its_end(tiny_model, tmp_path):
    """A draft engine built for fewer positions than the target proposes up to its last one,
    then no more: the target's output is unchanged (QA 25: the request failed at the draft's
    rotary tables)."""
    from builder.build import BuildConfig, build_engine
    from tests.conftest import make_tiny_hf

    _, engine_dir = tiny_model("llama-gqa")
    draft_dir = build_engine(make_tiny_hf("llama-gqa", str(tmp_path / "hf")), str(tmp_path / "draft"),
                             BuildConfig(max_seq_len=32, max_num_batched_tokens=32, max_num_seqs=16,
                                         block_size=4))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, 20).tolist(), rng.integers(0, 256, 40).tolist()]   # cross it, start past it
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(engine_dir, num_kv_blocks=64).generate(prompts, params)]
    llm = LLM(engine_dir, num_kv_blocks=64, speculative_config={
        "method": "draft_model", "draft_engine": draft_dir, "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == base
    assert llm.engine.stats()["spec_num_drafts"] > 0
    proposer = llm.engine.proposer
    assert proposer.kv.pool.num_free == proposer.kv.pool.num_blocks


def test_sampled_distribution_unchanged_by_speculation(tiny_model):
    """Chi-square two-sample test on the first speculatively verified token."""
    _, engine_dir = tiny_model("llama-mqa")
    prompt = np.random.default_rng(5).integers(0, 256, 12).tolist()
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    counts = []
    # the target as its own draft proposes its argmax at every decode step
    for spec in (None, {"method": "draft_model", "draft_engine": engine_dir, "num_speculative_tokens": 1}):
        llm = LLM(engine_dir, num_kv_blocks=256, seed=123 if spec else 321, speculative_config=spec)
        outs = llm.generate([prompt] * 800, params)
        counts.append(np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=256))
        if spec:
            assert llm.engine.stats()["spec_num_drafts"] > 100
    a, b = counts
    keep = (a + b) >= 10
    chi2 = float((((a - b) ** 2) / np.maximum(a + b, 1))[keep].sum()) + (a[~keep].sum() - b[~keep].sum()) ** 2 / max(
        a[~keep].sum() + b[~keep].sum(), 1)
    df = int(keep.sum())
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3   # Wilson-Hilferty, p = 0.001
    assert chi2 < critical, (chi2, critical)
