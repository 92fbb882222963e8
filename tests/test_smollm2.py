"""End to end on the real SmolLM2-135M-Instruct engine, against HF transformers."""
import numpy as np
import pytest
import torch

from trtllm_lite import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def hf_greedy(hf, ids, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_greedy_ids_match_hf(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.tokenizer
    chat = tok.encode(tok.apply_chat_template(CAPITAL), add_special_tokens=False)
    prompts = [chat] + [tok.encode(p) for p in (
        "The history of the Roman Empire", "def fibonacci(n):", "Water boils at")]
    outs = smollm2_llm.generate(prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, ids, 32)


def test_capital_of_france_is_paris(smollm2_llm):
    out = smollm2_llm.chat(CAPITAL, SamplingParams(max_tokens=32, temperature=0))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_batch_invariance(smollm2_llm):
    rng = np.random.default_rng(0)
    lengths = [3, 10, 29, 50, 77, 120, 160, 200]
    prompts = [rng.integers(100, 40000, n).tolist() for n in lengths]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [smollm2_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params)]
    assert together == alone


def test_inflight_batching_joins_running_decodes(smollm2_llm):
    engine = smollm2_llm.engine
    tok = smollm2_llm.tokenizer
    prompts = [tok.encode(t) for t in ("Once upon a time", "The best way to learn", "In 1969,")]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = [smollm2_llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    got = {}
    rid = engine.add_request(prompts[0], params)
    ids = [rid]
    for step in range(30):
        if step in (3, 7):  # new requests arrive while the first one decodes
            ids.append(engine.add_request(prompts[len(ids)], params))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        engine.kv.pool.check()
        if step == 8:
            assert len(engine.scheduler.running) == 3  # all three in flight together
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert [got[r] for r in ids] == alone
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_streaming_deltas_join_to_final_text(smollm2_llm):
    import asyncio

    from trtllm_lite import AsyncLLM

    params = SamplingParams(max_tokens=24, temperature=0)
    final = smollm2_llm.chat(CAPITAL, params)[0].outputs[0]
    tok = smollm2_llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template(CAPITAL), add_special_tokens=False)
    llm = AsyncLLM(engine=smollm2_llm.engine)

    async def collect():
        text, ids = "", []
        async for out in llm.generate(prompt, params):
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
        return text, ids

    try:
        text, ids = asyncio.run(collect())
    finally:
        llm.shutdown()
    assert (text, ids) == (final.text, final.token_ids)


def test_request_id_reused_right_after_cancel_is_refused_not_crossed(smollm2_llm):
    """A cancelled request's id stays taken until the engine aborted it: a new request
    under that id is refused instead of receiving the old request's final output."""
    import asyncio

    from trtllm_lite import AsyncLLM

    llm = AsyncLLM(engine=smollm2_llm.engine)

    async def go():
        gen = llm.generate("Old request about cats", SamplingParams(max_tokens=50, ignore_eos=True), "rid")
        await gen.__anext__()
        await gen.aclose()
        try:
            async for out in llm.generate("The capital of France is", SamplingParams(max_tokens=4), "rid"):
                assert out.prompt == "The capital of France is"
                assert out.outputs[0].finish_reason != "abort"
            return "served"
        except ValueError as e:
            assert "already in use" in str(e)
            return "refused"

    try:
        assert asyncio.run(go()) in ("served", "refused")
    finally:
        llm.shutdown()
    engine = smollm2_llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
