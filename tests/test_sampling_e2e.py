"""Sampling, stopping and streaming end to end on the real SmolLM2 engine."""
import asyncio

import pytest

from trtllm_lite import AsyncLLM, SamplingParams

PROMPT = "Once upon a time, in a small town by the sea, there lived a robot who"


@pytest.fixture(scope="module")
def greedy_reference(smollm2_llm):
    """The model's own greedy continuation: ids, per-token text, and the text."""
    out = smollm2_llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    ids = out.outputs[0].token_ids
    tok = smollm2_llm.tokenizer
    pieces = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    return ids, [b[len(a):] for a, b in zip([""] + pieces, pieces)], out.outputs[0].text


def stream(engine, prompt, params):
    llm = AsyncLLM(engine=engine)

    async def go():
        text, ids, last = "", [], None
        async for out in llm.generate(prompt, params):
            for c in out.outputs:
                text += c.text
                ids += c.token_ids
            last = out
        return text, ids, last

    try:
        return asyncio.run(go())
    finally:
        llm.shutdown()


def test_streamed_equals_non_streamed(smollm2_llm):
    for params in (SamplingParams(max_tokens=30, temperature=0),
                   SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=11, stop=["."])):
        final = smollm2_llm.generate([PROMPT], params)[0].outputs[0]
        text, ids, last = stream(smollm2_llm.engine, PROMPT, params)
        assert (text, ids) == (final.text, final.token_ids)
        assert last.outputs[-1].finish_reason == final.finish_reason


@pytest.mark.parametrize("where", ["ends_mid_token", "starts_mid_token", "spans_three_tokens"])
def test_stop_string_cuts_exactly_before_first_occurrence(smollm2_llm, greedy_reference, where):
    ids, pieces, text = greedy_reference
    # pick a token i with a multi-character piece, away from the start
    i = next(k for k in range(8, len(pieces)) if len(pieces[k].strip()) >= 3 and len(pieces[k + 1]) >= 2)
    start = sum(len(p) for p in pieces[:i])
    if where == "ends_mid_token":
        stop = text[start - 2:start + 2]              # last chars of token i-1 + first of token i
    elif where == "starts_mid_token":
        stop = text[start + 1:start + len(pieces[i]) + 1]
    else:
        stop = text[start - 1:start + len(pieces[i]) + 1]  # tail of i-1, all of i, head of i+1
    first = text.find(stop)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    out = smollm2_llm.generate([PROMPT], params)[0].outputs[0]
    assert out.text == text[:first]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    streamed, _, _ = stream(smollm2_llm.engine, PROMPT, params)
    assert streamed == text[:first]
    with_stop = smollm2_llm.generate([PROMPT], SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0]
    assert with_stop.outputs[0].text == text[:first + len(stop)]


def test_stop_string_that_never_completes_loses_no_text(smollm2_llm, greedy_reference):
    ids, pieces, text = greedy_reference
    stop = text[-3:] + "\u2603never"       # its head is the text's tail: held back, then released
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    out = smollm2_llm.generate([PROMPT], params)[0].outputs[0]
    assert out.text == text and out.finish_reason == "length"
    streamed, _, _ = stream(smollm2_llm.engine, PROMPT, params)
    assert streamed == text


def test_stop_token_on_last_allowed_token_is_stop_not_length(smollm2_llm, greedy_reference):
    ids, _, _ = greedy_reference
    out = smollm2_llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, stop_token_ids=[ids[4]]))[0]
    c = out.outputs[0]
    assert c.token_ids == ids[:5] and (c.finish_reason, c.stop_reason) == ("stop", ids[4])
    # the stop token's text is left out, unless include_stop_str_in_output, as vLLM (QA: never in)
    tok = smollm2_llm.tokenizer
    assert c.text == tok.decode(ids[:4])
    with_stop = smollm2_llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                              stop_token_ids=[ids[4]], include_stop_str_in_output=True))
    assert with_stop[0].outputs[0].text == tok.decode(ids[:5])


def test_seeded_requests_identical_alone_and_mixed(smollm2_llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=1234)
    alone = smollm2_llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    prompts = ["Hello there", PROMPT, "Numbers: 1, 2, 3,", PROMPT]
    params = [SamplingParams(max_tokens=16, temperature=1.0), seeded,
              SamplingParams(max_tokens=8, temperature=0.7), SamplingParams(max_tokens=16, temperature=1.2)]
    mixed = smollm2_llm.generate(prompts, params)
    assert mixed[1].outputs[0].token_ids == alone


def test_n4_with_seed_is_reproducible_and_shares_prompt_blocks(smollm2_llm):
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=5)
    a = smollm2_llm.generate([PROMPT], params)[0]
    b = smollm2_llm.generate([PROMPT], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert sorted(c.index for c in a.outputs) == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    engine = smollm2_llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=1))
    while len(engine.requests[rid].seqs) < 4:
        engine.step()
    tables = [s.block_table for s in engine.requests[rid].seqs]
    full = len(engine.requests[rid].prompt_token_ids) // engine.block_size
    assert all(t[:full] == tables[0][:full] for t in tables)       # prompt blocks shared
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_max_tokens_one_gives_one_token(smollm2_llm):
    out = smollm2_llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.8, seed=0))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_logprobs_and_prompt_logprobs_shapes(smollm2_llm, greedy_reference):
    ids, _, _ = greedy_reference
    out = smollm2_llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3,
                                                        prompt_logprobs=2))[0]
    c = out.outputs[0]
    assert c.token_ids == ids[:6] and len(c.logprobs) == 6
    for token, lp in zip(c.token_ids, c.logprobs):
        assert token in lp and lp[token].rank == 1            # greedy picks the top token
        assert len(lp) == 3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_bad_words_are_never_generated(smollm2_llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    plain = smollm2_llm.chat(chat, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    banned = smollm2_llm.chat(chat, SamplingParams(max_tokens=12, temperature=0, bad_words=["Paris"]))[0]
    assert "Paris" in plain and "Paris" not in banned.outputs[0].text
