"""The OpenAI-compatible HTTP front end, driven by the official ``openai`` package (and
httpx for raw status codes), against real server processes on 127.0.0.1 serving SmolLM2
over gRPC and HTTP from one engine. References: ``LLM.generate`` / ``LLM.chat`` here."""
from __future__ import annotations

import asyncio
import json
import re
import ssl
import threading
import time

import httpx

import pytest

from trtllm_lite import SamplingParams
from trtllm_lite.serving.client import LLMClient
from trtllm_lite.serving.process import ServerProcess, wait_until

from .test_serving_grpc import idle_blocks, loop_gaps, tls_files  # noqa: F401 - tls_files is a fixture

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

ENGINE_ARGS = ("--num-threads", "2", "--no-verify-checksums", "--num-kv-blocks", "512", "--http-port", "0")
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_engine):
    with ServerProcess(smollm2_engine, *ENGINE_ARGS) as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"http://{server.http}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    with LLMClient(server.grpc, timeout=120) as c:
        yield c


def test_completions_stream_equals_whole_equals_llm(oai, smollm2_llm):
    ref = smollm2_llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))[0]
    whole = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == text == ref.outputs[0].text
    assert whole.choices[0].finish_reason == [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].choices == []                      # the usage chunk
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")


def test_chat_stream_equals_whole_equals_llm(oai, smollm2_llm):
    ref = smollm2_llm.chat(MESSAGES, SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0]
    whole = oai.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=20, temperature=0)
    chunks = list(oai.chat.completions.create(model="smollm2", messages=MESSAGES, max_completion_tokens=20,
                                              temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.content == text == ref.text
    assert "Paris" in text and chunks[0].choices[0].delta.role == "assistant"
    # vLLM's shape: the role alone first, then content deltas without it (QA: role came with text)
    assert chunks[0].choices[0].delta.content == "" and all(c.choices[0].delta.role is None for c in chunks[1:])
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == ref.finish_reason == "stop"
    assert whole.usage.completion_tokens == len(ref.token_ids)


def test_n2_with_seed_is_reproducible(oai):
    kw = dict(model="smollm2", prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=1234, n=2)
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20


def test_stop_string_logprobs_and_max_tokens_1(oai, smollm2_llm):
    ref = smollm2_llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].text
    stop = ref.split()[1]
    cut = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == ref[:ref.index(stop)] and cut.choices[0].finish_reason == "stop"
    lp = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == lp.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert chosen <= 0 and max(top.values()) == pytest.approx(chosen)   # greedy: the top token
    chat = oai.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    one = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"


def test_echoed_prompt_tokens_top_logprobs_hold_logprobs_n_not_prompt_logprobs_n(server, smollm2_llm):
    """With ``echo``, ``logprobs: 1`` and ``prompt_logprobs: 4``, each echoed prompt token's
    ``top_logprobs`` held 4 alternatives (QA); as vLLM, it holds the top ``logprobs`` plus the
    prompt token itself, while ``choices[].prompt_logprobs`` keeps all 4. Reference: the
    engine's own prompt_logprobs through ``LLM.generate``, capped here by rank."""
    ref = smollm2_llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, prompt_logprobs=4))[0]
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 4}
    choice = httpx.post(f"http://{server.http}/v1/completions", json=body, timeout=120).json()["choices"][0]
    ids, out = ref.prompt_token_ids, ref.outputs[0]
    tops = choice["logprobs"]["top_logprobs"]
    assert len(tops) == len(ids) + len(out.token_ids) and tops[0] is None
    for got, token, entry in zip(tops[1:], ids[1:] + out.token_ids, ref.prompt_logprobs[1:] + out.logprobs):
        want = {v.decoded_token: v.logprob for t, v in entry.items() if v.rank <= 1 or t == token}
        assert got == pytest.approx(want, abs=1e-4)
    assert any(len(top) == 2 for top in tops[1:len(ids)])   # a prompt token that is not the top one
    assert_vllm_prompt_logprobs(choice["prompt_logprobs"], ref, 4)


def strict_json(text: str):
    """JSON as the standard has it: ``-Infinity`` and ``NaN`` are not JSON."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def assert_alternatives(got: dict, entry) -> None:
    """``got`` (text -> logprob) holds ``entry``'s alternatives (the engine's ``{id: Logprob}``),
    those ruled out of the sampled distribution (-inf; which of them is arbitrary) as -9999.0."""
    assert len(got) == len(entry)
    live = {v.decoded_token: v.logprob for v in entry.values() if v.logprob > -9999.0}
    assert {k: v for k, v in got.items() if v > -9999.0} == pytest.approx(live, abs=1e-4)
    assert all(v == -9999.0 for k, v in got.items() if k not in live)


def test_alternatives_ruled_out_by_top_k_are_minus_9999_not_a_500(server, smollm2_llm):
    """Sampled with ``top_k: 2`` and 5 logprobs asked for, the alternatives past the top 2 have
    -inf logprobs in the distribution sampled from: the answer was a 500 and a streamed chunk
    carried ``-Infinity``, which is not JSON (found fixing prompt_logprobs). As vLLM and OpenAI,
    they are -9999.0. Reference: the engine's own logprobs through ``LLM.generate`` /
    ``LLM.chat`` with the same seed."""
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=7, logprobs=5)
    refs = {"completions": smollm2_llm.generate(PROMPT, params)[0].outputs[0],
            "chat/completions": smollm2_llm.chat(MESSAGES, params)[0].outputs[0]}
    common = {"model": "smollm2", "max_tokens": 3, "temperature": 1.0, "top_k": 2, "seed": 7}
    base = f"http://{server.http}/v1"
    for route, extra in (("completions", {"prompt": PROMPT, "logprobs": 5}),
                         ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 5})):
        ref = refs[route]
        assert len(ref.token_ids) == 3 and any(v.logprob == float("-inf") for v in ref.logprobs[0].values())
        r = httpx.post(f"{base}/{route}", json={**common, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        lp = strict_json(r.text)["choices"][0]["logprobs"]
        with httpx.stream("POST", f"{base}/{route}", json={**common, **extra, "stream": True}, timeout=120) as s:
            chunks = [strict_json(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert all("error" not in c for c in chunks)
        if route == "completions":
            tops = lp["top_logprobs"]
            assert completion_logprobs([c["choices"][0] for c in chunks])["top_logprobs"] == tops
        else:
            tops = [{a["token"]: a["logprob"] for a in c["top_logprobs"]} for c in lp["content"]]
        assert len(tops) == 3
        for got, entry in zip(tops, ref.logprobs):
            assert_alternatives(got, entry)


def completion_logprobs(choices) -> dict:
    """One choice's ``logprobs`` lists joined over its streamed pieces."""
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in choices:
        for key in joined:
            joined[key] += c["logprobs"][key] if c["logprobs"] else []
    return joined


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_first(server, smollm2_llm):
    """/v1/completions with ``echo`` and ``logprobs: N`` lists the prompt's tokens first, with
    their logprobs (the first token's null, as vLLM), then the generated ones; they were left
    out (QA). Reference: the engine's own prompt_logprobs through ``LLM.generate``; streamed
    pieces joined equal the whole answer, text offsets running on across pieces."""
    prompts = [PROMPT, "def fibonacci(n):"]
    tok = smollm2_llm.tokenizer
    refs = smollm2_llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=2))
    body = {"model": "smollm2", "prompt": prompts, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    url = f"http://{server.http}/v1/completions"
    whole = httpx.post(url, json=body, timeout=120).json()["choices"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for i, (ref, choice) in enumerate(zip(refs, whole)):
        out, ids, n = ref.outputs[0], ref.prompt_token_ids, len(ref.prompt_token_ids)
        lp = choice["logprobs"]
        assert choice["text"] == prompts[i] + out.text
        assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ids + out.token_ids]
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["text_offset"] == [len("".join(lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = [e[t] for e, t in zip(ref.prompt_logprobs[1:] + out.logprobs, ids[1:] + out.token_ids)]
        assert lp["token_logprobs"][1:] == pytest.approx([w.logprob for w in want], abs=1e-4)
        for got, entry in zip(lp["top_logprobs"][1:], ref.prompt_logprobs[1:] + out.logprobs):
            assert got == pytest.approx({v.decoded_token: v.logprob for v in entry.values()}, abs=1e-4)
        streamed = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in streamed) == choice["text"]
        joined = completion_logprobs(streamed)
        assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
        assert joined["token_logprobs"][0] is None and joined["top_logprobs"][0] is None
        assert joined["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    plain = httpx.post(url, json={**body, "echo": False}, timeout=120).json()["choices"][0]["logprobs"]
    assert plain["tokens"] == whole[0]["logprobs"]["tokens"][len(refs[0].prompt_token_ids):]
    assert plain["text_offset"][0] == 0


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_streamed_logprobs_keep_tokens_whose_text_is_held_back(server, smollm2_llm, route):
    """A token whose text is held back (here: it begins a stop string that then does not
    follow) came in no chunk, so its logprobs were lost from the stream; now it comes in a
    chunk of empty text, and the streamed logprobs are the whole answer's."""
    tok = smollm2_llm.tokenizer
    chat = route != "completions"
    params = SamplingParams(max_tokens=4, temperature=0.0)
    ref = (smollm2_llm.chat(MESSAGES, params) if chat else smollm2_llm.generate(PROMPT, params))[0].outputs[0]
    held = tok.decode(ref.token_ids[:2])          # the first two tokens' text waits for the third
    assert ref.text.startswith(held) and len(held.strip()) > 1
    body = {"model": "smollm2", "max_tokens": 4, "temperature": 0, "stop": [held + "\u2603"],
            **({"messages": MESSAGES, "logprobs": True, "top_logprobs": 1} if chat else
               {"prompt": PROMPT, "logprobs": 1})}
    url = f"http://{server.http}/v1/{route}"
    whole = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    want = [tok.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    if chat:
        assert [c["token"] for c in whole["logprobs"]["content"]] == want
        assert [c["token"] for ch in chunks if ch["logprobs"] for c in ch["logprobs"]["content"]] == want
    else:
        assert whole["logprobs"]["tokens"] == want
        assert completion_logprobs(chunks)["tokens"] == want
        assert completion_logprobs(chunks)["text_offset"] == whole["logprobs"]["text_offset"]


def assert_vllm_prompt_logprobs(got, ref, n: int) -> None:
    """``got`` is ``ref``'s prompt logprobs (the engine's own, top-``n``) in vLLM's JSON shape:
    per prompt token, null for the first, else ``{"<token id>": {"logprob", "rank",
    "decoded_token"}}`` holding the prompt token itself and the top-``n``."""
    ids = ref.prompt_token_ids
    assert len(got) == len(ids) and got[0] is None
    for token, entry, want in zip(ids[1:], got[1:], ref.prompt_logprobs[1:]):
        assert str(token) in entry and set(entry) == {str(t) for t in want}
        assert sorted(e["rank"] for e in entry.values())[:n] == list(range(1, n + 1))
        for t, lp in want.items():
            e = entry[str(t)]
            assert e["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert (e["rank"], e["decoded_token"]) == (lp.rank, lp.decoded_token)


def test_prompt_logprobs_are_returned_where_vllm_puts_them(server, smollm2_llm):
    """``prompt_logprobs: N`` without ``echo`` was computed and then dropped (QA). As vLLM, it
    comes back on each completion choice and on the chat response itself (not its choices), for
    non-streamed answers; with ``stream: true`` it is a 400 naming it on both routes (vLLM's
    rule: above 0; 0 streams). Reference: the engine's own prompt_logprobs through
    ``LLM.generate`` / ``LLM.chat``."""
    prompts = [PROMPT, "def fibonacci(n):"]
    refs = smollm2_llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
    chat_ref = smollm2_llm.chat(MESSAGES, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    base, common = f"http://{server.http}/v1", {"model": "smollm2", "max_tokens": 2, "temperature": 0}
    choices = httpx.post(f"{base}/completions", json={**common, "prompt": prompts, "n": 2, "prompt_logprobs": 3},
                         timeout=120).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        assert_vllm_prompt_logprobs(c["prompt_logprobs"], refs[c["index"] // 2], 3)
    chat = httpx.post(f"{base}/chat/completions", json={**common, "messages": MESSAGES, "prompt_logprobs": 2},
                      timeout=120).json()
    assert_vllm_prompt_logprobs(chat["prompt_logprobs"], chat_ref, 2)
    assert "prompt_logprobs" not in chat["choices"][0]
    plain = httpx.post(f"{base}/completions", json={**common, "prompt": PROMPT}, timeout=120).json()
    assert plain["choices"][0]["prompt_logprobs"] is None
    for route, extra in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": MESSAGES})):
        r = httpx.post(f"{base}/{route}", json={**common, **extra, "stream": True, "prompt_logprobs": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert "stream" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{base}/{route}", json={**common, **extra, "stream": True, "prompt_logprobs": 0},
                          timeout=60) as ok:
            lines = [line for line in ok.iter_lines() if line.startswith("data: ")]
        assert ok.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)


def test_16_concurrent_streams(server, smollm2_llm):
    prompts = ["Once upon a time", "def fibonacci(n):", "Water boils at", "My favourite colour is"]
    refs = {p: smollm2_llm.generate(p, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
            for p in prompts}

    async def run():
        async with openai.AsyncOpenAI(base_url=f"http://{server.http}/v1", api_key="none", max_retries=0) as c:
            async def one(p):
                stream = await c.completions.create(model="smollm2", prompt=p, max_tokens=8, temperature=0,
                                                    stream=True)
                return p, "".join([ch.choices[0].text async for ch in stream if ch.choices])
            return await asyncio.gather(*[one(p) for p in prompts * 4])

    for prompt, text in asyncio.run(run()):
        assert text == refs[prompt], prompt


def metric_values(server) -> dict[str, float]:
    """The server's /metrics samples: ``{name (with its labels): value}``."""
    body = httpx.get(f"http://{server.http}/metrics", timeout=30).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
            if line.startswith("trtllm_lite_") and " " in line}


def token_counters(server) -> tuple[float, float]:
    """(prompt_tokens_total, generation_tokens_total) from the server's /metrics."""
    values = metric_values(server)
    return values["trtllm_lite_prompt_tokens_total"], values["trtllm_lite_generation_tokens_total"]


def test_client_closing_stream_frees_blocks(server, grpc_client, smollm2_llm):
    """A stream the client closes part way frees its blocks, and the tokens the engine
    computed for it count in the token counters (as vLLM counts them)."""
    prompt = "Tell me a story."
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    prompt_before, generated_before = token_counters(server)
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", f"http://{server.http}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert grpc_client.model_info().kv_blocks_used > 0
    assert wait_until(lambda: idle_blocks(grpc_client), timeout=15)
    received = sum(1 for line in got if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"])
    prompt_after, generated_after = token_counters(server)
    assert prompt_after - prompt_before == len(smollm2_llm.tokenizer.encode(prompt))
    assert received <= generated_after - generated_before < 400


def test_client_leaving_a_stream_during_its_prompt_aborts_it_then(server, grpc_client):
    """A streaming client that leaves while its long prompt is computed is noticed then: the
    request is aborted before its first token, which is never generated (it was noticed only
    at the first token, 2-9 s later, QA 23), and counted as cancelled."""
    prompt = list(range(1000, 1990))   # ~2 s of prefill on 2 cores

    def counts():
        values = metric_values(server)
        return (values["trtllm_lite_generation_tokens_total"],
                values.get('trtllm_lite_request_outcomes_total{outcome="cancelled"}', 0.0))

    generated, cancelled = counts()
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "stream": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"http://{server.http}/v1/completions", json=body, timeout=0.3)
    assert wait_until(lambda: idle_blocks(grpc_client), timeout=15)
    assert wait_until(lambda: counts()[1] == cancelled + 1, timeout=15)
    assert counts()[0] == generated


def test_client_leaving_a_non_streamed_request_frees_blocks(server, grpc_client):
    """... counts as cancelled (its 499 reaches no one), and its unknown fields are logged: the
    engine ran it (QA 24: a request that never answered, timed out or left, logged none, where
    the misspelt field may be why)."""
    def cancelled():
        return metric_values(server).get('trtllm_lite_request_outcomes_total{outcome="cancelled"}', 0.0)

    before = cancelled()
    body = {"model": "smollm2", "prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True,
            "zz_left_early": 1}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"http://{server.http}/v1/completions", json=body, timeout=1.5)
    assert wait_until(lambda: idle_blocks(grpc_client), timeout=15)
    assert wait_until(lambda: cancelled() == before + 1, timeout=15)
    assert wait_until(lambda: any("request fields ignored" in line and "zz_left_early" in line
                                  for line in server.stderr_lines), timeout=10)


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": [1] * 1500}, 400, None),                               # longer than max_seq_len
    ({"prompt": "Hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    # keys are canonical decimal token ids; int() took these (QA)
    ({"prompt": "Hi", "logit_bias": {" 5": 1}}, 400, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"-0": 1}}, 400, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"+5": 1}}, 400, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"05": 1}}, 400, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"1_0": 1}}, 400, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),   # past int()'s 4300 digits (QA)
    ({"prompt": "Hi", "model": "gpt-4"}, 404, None),
    ({}, 400, "prompt"),
    # without stream there is no stream to configure: OpenAI and vLLM refuse it (QA 16b)
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
])
def test_error_statuses(server, oai, body, status, param):
    r = httpx.post(f"http://{server.http}/v1/completions", json={"model": "smollm2", **body}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == status
    if param:
        assert err["param"] == param or param in err["message"]
    if "prompt" in body and body["prompt"] == [1] * 1500:
        assert "1024" in err["message"]
    assert oai.completions.create(model="smollm2", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_logit_bias_by_decimal_token_id_steers_the_output(server, smollm2_llm):
    token = smollm2_llm.tokenizer.encode(" banana")[0]
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "logit_bias": {str(token): 100, "0": 0}}
    r = httpx.post(f"http://{server.http}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == smollm2_llm.tokenizer.decode([token])


def test_chat_text_part_without_text_is_400(server):
    # OpenAI requires `text` on a text part; it was read as "" and answered 200.
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    r = httpx.post(f"http://{server.http}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "text" in r.json()["error"]["message"]


@pytest.mark.parametrize("content, message", [
    ([{"text": "Hi"}], "messages.0.content.0.type: Field required"),
    ([{"type": "text", "text": 5}], "messages.0.content.0.text: Input should be a valid string"),
    (["Hi"], "messages.0.content.0: a content part must be an object such as"),
    (5, "messages.0.content: must be a string or a list of content parts"),
    ({"type": "text", "text": "Hi"}, "messages.0.content: must be a string or a list of content parts"),
])
def test_chat_content_of_no_accepted_form_names_what_is_wrong(server, content, message):
    """A content part without ``type`` was reported as pydantic's first union member's error,
    "messages.0.content: Input should be a valid string" (QA 23): the error now comes from
    the form the JSON has (a list: the part's own error), or lists the accepted forms."""
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(f"http://{server.http}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and r.json()["error"]["message"].startswith(message), r.text
    assert "ContentPart" not in r.json()["error"]["message"]


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": "Hi \ud800 there"}, "prompt"),                 # JSON's lone surrogate
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("completions", {"prompt": "Hi", "bad_words": ["ok", "no\ud800"]}, "bad_words"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "bad_words": ["\udc00"]}, "bad_words"),
    ("completions", {"prompt": "Hi", "stop": "\ud800"}, "stop"),             # it was accepted (QA)
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stop": ["ok", "a\udbff"]}, "stop"),
    # hashed into the prefix-cache keys inside an engine step, where it failed every request of
    # the step with a 500 (QA 23)
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "cache_salt": "\udc00"}, "cache_salt"),
])
def test_text_that_is_not_unicode_is_400_naming_it(server, oai, route, body, param):
    raw = ('{"model": "smollm2", "max_tokens": 2, ' + json.dumps(body)[1:]).encode()   # keeps the \ud800 escape
    assert re.search(rb"\\ud[89a-f]", raw)   # the escape JSON allows, decoded by the server
    r = httpx.post(f"http://{server.http}/v1/{route}", content=raw, timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "not valid Unicode" in r.json()["error"]["message"]
    assert oai.completions.create(model="smollm2", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_bad_words_are_never_generated_as_over_grpc(oai, smollm2_llm):
    """vLLM's OpenAI server takes ``bad_words`` (a list of strings), as our gRPC API does; HTTP
    dropped the field silently and generated the word anyway (QA)."""
    free = smollm2_llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].text
    ref = smollm2_llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                      bad_words=["Paris"]))[0].outputs[0].text
    assert "Paris" in free and "Paris" not in ref
    got = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"bad_words": ["Paris"]})
    assert got.choices[0].text == ref
    chat_free = smollm2_llm.chat(MESSAGES, SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0].text
    chat_ref = smollm2_llm.chat(MESSAGES, SamplingParams(max_tokens=20, temperature=0.0,
                                                         bad_words=["Paris"]))[0].outputs[0].text
    assert "Paris" in chat_free and "Paris" not in chat_ref
    chat = oai.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=20, temperature=0,
                                       extra_body={"bad_words": ["Paris"]})
    assert chat.choices[0].message.content == chat_ref


def bad_words_over_the_limit(llm) -> list[str]:
    """Bad words with more characters in all than max_seq_len tokens can cover (each alone fits)."""
    limit = llm.engine.scheduler_config.max_seq_len * llm.engine.tokenizer.max_chars_per_token
    return ["x" * (limit // 2), "y" * (limit // 2 + 1)]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("bad_words, message", [
    ("Paris", "bad_words: "),                       # a string, not a list of strings
    ([5], "bad_words.0: "),
    ([["Paris"]], "bad_words.0: "),
    ([""], "bad_words must be non-empty strings, not only spaces"),
    ([" "], "bad_words must be non-empty strings, not only spaces"),   # said "non-empty" alone
    ("over the limit", "bad_words has "),           # refused before it is tokenized, as over gRPC
])
def test_bad_bad_words_are_400_naming_them(server, smollm2_llm, route, bad_words, message):
    if bad_words == "over the limit":
        bad_words = bad_words_over_the_limit(smollm2_llm)
    body = {"model": "smollm2", "max_tokens": 2, "bad_words": bad_words,
            **({"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})}
    r = httpx.post(f"http://{server.http}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "bad_words" and error["message"].startswith(message), error


@pytest.mark.parametrize("stop, message", [
    (["x"] * 20000, "stop has 20000 words: more than max_seq_len"),
    ("over the limit", "stop has "),
])
def test_stop_lists_past_the_bad_words_limits_are_400_naming_stop(server, smollm2_llm, stop, message):
    """Stop strings are searched for at every new token: more than max_seq_len of them, or
    more characters than max_seq_len tokens can hold (never matched), are refused as bad_words
    are (QA 19: 100,000 stop strings slowed the engine's steps)."""
    if stop == "over the limit":
        stop = bad_words_over_the_limit(smollm2_llm)
    r = httpx.post(f"http://{server.http}/v1/completions", timeout=60,
                   json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "stop": stop})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "stop" and error["message"].startswith(message), error


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stop", [5, {"a": 1}, True])
def test_stop_of_no_accepted_form_is_400_listing_the_forms(server, route, stop):
    """``stop`` that is neither a string nor a list of strings: a 400 naming stop and both
    forms (it said only "Input should be a valid string"; QA 20)."""
    body = {"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(f"http://{server.http}{route}", json={**body, "max_tokens": 2, "stop": stop}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    assert r.json()["error"]["message"] == "stop: must be a string or a list of strings", r.text


@pytest.mark.parametrize("prompt", [[1, "a"], 5, [1.5], {"a": 1}])
def test_prompt_of_no_accepted_form_is_400_listing_the_forms(server, prompt):
    r = httpx.post(f"http://{server.http}/v1/completions", json={"model": "smollm2", "prompt": prompt}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "a list of token ids" in r.json()["error"]["message"]


@pytest.mark.parametrize("value", [0, 10 ** 6])
def test_chat_max_completion_tokens_error_names_it(server, value):
    """A chat request's bad ``max_completion_tokens`` (below 1, or past what max_seq_len
    leaves after the prompt) is a 400 naming that field, not the ``max_tokens`` it maps to."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": value}
    r = httpx.post(f"http://{server.http}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


@pytest.mark.parametrize("tool_choice, status", [
    ("required", 400), ({"type": "function", "function": {"name": "get_weather"}}, 400), ("any", 400),
    ("none", 200), ("auto", 200), (None, 200)])
def test_chat_tool_choice_that_asks_for_a_tool_call_is_400_naming_it(server, tool_choice, status):
    """This server has no tool calling (``tools`` is a 400): a ``tool_choice`` that demands a
    tool call ("required", a named function) is a 400 naming ``tool_choice``, as vLLM answers it
    without tools, where it was ignored and text came back; "none" and "auto" give text."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "tool_choice": tool_choice}
    r = httpx.post(f"http://{server.http}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "tool_choice", r.text


@pytest.mark.parametrize("route, extra", [
    ("chat/completions", {"functions": [{"name": "f", "parameters": {}}]}),
    ("chat/completions", {"function_call": {"name": "f"}}),
    ("chat/completions", {"guided_json": {"type": "object"}}),
    ("chat/completions", {"guided_choice": ["yes", "no"]}),
    ("completions", {"guided_regex": "[0-9]+"}),
    ("completions", {"guided_grammar": "root ::= \"a\""}),
    ("completions", {"structured_outputs": {"choice": ["a"]}}),
    ("completions", {"response_format": {"type": "json_object"}}),
    # vLLM's chat-template extras: continue_final_message was ignored and gave "" (QA)
    ("chat/completions", {"continue_final_message": True}),
    ("chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("chat/completions", {"chat_template": "{{ messages[0]['content'] }}"}),
    ("chat/completions", {"echo": True}),
])
def test_fields_that_constrain_the_output_are_400_not_ignored(server, route, extra):
    """Legacy function calling and vLLM's guided decoding would be obeyed by a peer; ignoring
    them (200, unconstrained text, only a log line) answered as if they were: a 400 naming the
    field, as ``tools`` is. ``function_call`` "none" / "auto" and a text ``response_format``
    ask for nothing and are served."""
    body = {"model": "smollm2", "max_tokens": 2, **extra,
            **({"messages": MESSAGES} if route.startswith("chat") else {"prompt": PROMPT})}
    r = httpx.post(f"http://{server.http}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text
    before = len(server.stderr_lines)
    for ok in ({"function_call": "auto"}, {"response_format": {"type": "text"}}):
        ok_body = {**body, **ok}
        ok_body.pop(next(iter(extra)) if next(iter(extra)) not in ok else "", None)
        assert httpx.post(f"http://{server.http}/v1/{route}", json=ok_body, timeout=60).status_code == 200
    # read and accepted, so not logged as ignored (QA); completions do not read function_call
    time.sleep(0.2)
    logged = "".join(server.stderr_lines[before:])
    assert "'response_format'" not in logged and ("'function_call'" in logged) is (route == "completions"), logged


def test_chat_text_parts_are_joined_by_newlines_as_vllm_does(server, smollm2_llm):
    """A message's text parts are one text joined with "\n" (vLLM's string content format),
    not glued together ("Hello" + "world" read as "Helloworld")."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    body = {"model": "smollm2", "messages": parts, "max_tokens": 1}
    got = httpx.post(f"http://{server.http}/v1/chat/completions", json=body, timeout=60).json()
    joined = smollm2_llm.tokenizer.encode(smollm2_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello\nworld"}]), add_special_tokens=False)
    assert got["usage"]["prompt_tokens"] == len(joined)


def test_chat_logprobs_bytes_are_each_tokens_own_utf8_bytes(oai, smollm2_llm):
    """OpenAI's ``bytes`` let a client join the tokens of one character: a byte-level token
    that holds part of an emoji gives its own bytes (F0 9F), not U+FFFD's, and the bytes of all
    tokens decode to the message."""
    first = smollm2_llm.tokenizer.encode("\U0001F600", add_special_tokens=False)[0]
    messages = [{"role": "user", "content": "Repeat exactly: \U0001F600"}]
    r = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=1, temperature=0,
                                    logprobs=True, top_logprobs=2, logit_bias={str(first): 100})
    assert r.choices[0].logprobs.content[0].bytes == [0xF0, 0x9F]
    r = oai.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0, logprobs=True)
    c = r.choices[0]
    joined = bytes(b for t in c.logprobs.content for b in t.bytes)
    assert joined.decode("utf-8", "ignore").removesuffix("<|im_end|>") == c.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_text_offset_counts_characters_past_tokens_that_split_one(oai, stream):
    """``text_offset`` is each token's start in the text, in characters: the emoji and the CJK
    characters here are several byte-level tokens each, whose own texts are U+FFFD; counting
    those drifted every later offset (QA). Whole tokens sit at their offsets."""
    prompt = "\U0001F600 test \u65e5\u672c\u8a9e end"
    kwargs = dict(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    if stream:
        chunks = list(oai.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    else:
        choice = oai.completions.create(**kwargs).choices[0]
        text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    assert text[offsets[tokens.index(" test")]:].startswith(" test")
    assert text[offsets[tokens.index(" end")]:].startswith(" end")
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:
            assert text[offset:offset + len(token)] == token, (token, offset, text)


def test_text_offset_and_echo_with_special_tokens(oai, smollm2_llm):
    """A token-id prompt is echoed with its special tokens' text (as vLLM echoes it), so its
    offsets line up; a generated special token that the text leaves out (skip_special_tokens)
    takes no room in it (QA: each shifted every later offset)."""
    ids = smollm2_llm.tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    choice = oai.completions.create(model="smollm2", prompt=ids, max_tokens=2, temperature=0, echo=True,
                                    logprobs=1).choices[0]
    assert choice.text.startswith("<|im_start|>user\nhi<|im_end|>")
    for token, offset in zip(choice.logprobs.tokens[:len(ids)], choice.logprobs.text_offset):
        assert choice.text[offset:offset + len(token)] == token
    special = smollm2_llm.tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    choice = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                    logprobs=1, logit_bias={str(special): 100}).choices[0]
    assert choice.text == PROMPT and choice.logprobs.text_offset[-3:] == [len(PROMPT)] * 3


def test_completions_function_call_is_logged_as_ignored(server):
    """Chat reads ``function_call``; completions do not, so there it is an ignored field the
    log names (QA: the chat route's exemption hid it on completions too)."""
    before = len(server.stderr_lines)
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 1, "function_call": {"name": "f"}}
    assert httpx.post(f"http://{server.http}/v1/completions", json=body, timeout=60).status_code == 200
    assert wait_until(lambda: "'function_call'" in "".join(server.stderr_lines[before:]), timeout=5)


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(oai):
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk
    carries the usage so far, its completion tokens growing to the final count."""
    chunks = list(oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 6
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    # chat: the role-only first chunk has sent no completion token yet, as vLLM's (QA: it counted 2)
    chat = list(oai.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert chat[0].usage.total_tokens == chat[0].usage.prompt_tokens and chat[-1].usage.completion_tokens > 0


def test_echo_with_max_tokens_0_answers_the_prompt_alone_to_score_it(oai, server, smollm2_llm):
    """``echo`` with ``max_tokens: 0`` (OpenAI's legacy API, vLLM): the prompt's text and its
    logprobs (the first null), no completion tokens, streamed or not; the logprobs are those
    that ``max_tokens: 1`` gives the prompt. ``max_tokens: 0`` without echo stays a 400."""
    n = len(smollm2_llm.tokenizer.encode(PROMPT))
    c = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ch = c.choices[0]
    assert ch.text == PROMPT and c.usage.completion_tokens == 0 and c.usage.prompt_tokens == n
    assert len(ch.logprobs.tokens) == n and ch.logprobs.token_logprobs[0] is None
    ref = oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert ref.choices[0].logprobs.token_logprobs[:n] == ch.logprobs.token_logprobs
    chunks = list(oai.completions.create(model="smollm2", prompt=[PROMPT, "Hello there"], max_tokens=0, echo=True,
                                         stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for k in chunks:
        for x in k.choices:
            texts[x.index] = texts.get(x.index, "") + x.text
    assert texts == {0: PROMPT, 1: "Hello there"} and chunks[-1].usage.completion_tokens == 0
    r = httpx.post(f"http://{server.http}/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 0},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": -1, "max_completion_tokens": 5}, "max_tokens"),
    ({"max_tokens": 0, "max_completion_tokens": 5}, "max_tokens"),
    ({"max_tokens": 2.5, "max_completion_tokens": 5}, "max_tokens"),
    ({"max_tokens": "5", "max_completion_tokens": 5}, "max_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": -3}, "max_completion_tokens"),
])
def test_chat_bad_max_tokens_is_400_even_beside_a_good_max_completion_tokens(server, fields, param):
    """Every field sent is checked, as OpenAI's API does: a bad ``max_tokens`` is a 400 naming
    it even when ``max_completion_tokens`` (which wins) is good, and the reverse (a negative
    or zero ``max_tokens`` was silently ignored)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], **fields}
    r = httpx.post(f"http://{server.http}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_completions_null_max_tokens_runs_to_max_model_len_and_absent_is_16(server, smollm2_llm):
    """As vLLM: a null ``max_tokens`` on /v1/completions is what is left of max_model_len (1024)
    after each prompt of the batch (it ran with the default of 16; QA); an absent one is 16,
    OpenAI's legacy default and vLLM's."""
    sentence = "The quick brown fox jumps over the lazy dog. "
    texts = [sentence * 101, sentence * 100]
    lengths = [len(smollm2_llm.tokenizer.encode(t)) for t in texts]
    assert 1024 - 16 < lengths[0] < 1024 and lengths[1] < lengths[0]   # the first: less room than 16
    ids = smollm2_llm.tokenizer.encode("Paged attention keeps the cache in blocks. " * 120)[:1000]
    url = f"http://{server.http}/v1/completions"
    body = {"model": "smollm2", "ignore_eos": True, "temperature": 0, "logprobs": 0}
    r = httpx.post(url, json={**body, "prompt": texts, "max_tokens": None}, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [1024 - n for n in lengths]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    r = httpx.post(url, json={**body, "prompt": ids, "max_tokens": None}, timeout=120)
    assert r.json()["usage"]["completion_tokens"] == 1024 - 1000, r.text
    absent = httpx.post(url, json={**body, "prompt": ids}, timeout=120).json()
    assert absent["usage"]["completion_tokens"] == 16


def test_more_prompts_than_the_queue_holds_is_400_naming_prompt(server):
    """A completions batch is one request per prompt, queued at once: more prompts than
    max_waiting_requests (256 here) is refused up front, a 400 naming prompt (20,000 prompts
    held the event loop, /health with it, ~14 s before a 429; QA); 256 are taken."""
    url = f"http://{server.http}/v1/completions"
    r = httpx.post(url, json={"model": "smollm2", "prompt": ["hi"] * 20_000, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "20000 prompts: more than max_waiting_requests (256)" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "smollm2", "prompt": [[11]] * 256, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 256
    # counted in sequences: 256 prompts x n 64 in a 2 KB body held the server 88 s (QA)
    r = httpx.post(url, json={"model": "smollm2", "prompt": [[11]] * 256, "n": 64, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "256 prompts x n 64 = 16384 sequences: more than max_waiting_requests (256)" in r.json()["error"]["message"]


def test_bad_json_is_400(server):
    r = httpx.post(f"http://{server.http}/v1/completions", content=b'{"prompt": "caf\xe9", "max_tokens": 1}',
                   timeout=30, headers={"content-type": "application/json"})   # Latin-1, not UTF-8 (QA 21)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "the body is not valid UTF-8: byte 15: invalid continuation byte"
    # UTF-16 with its byte order mark is read as such; an odd byte count is named as UTF-16's
    # fault (it was called UTF-8: QA, session 33)
    r = httpx.post(f"http://{server.http}/v1/completions", content=b'\xff\xfe{"prompt":"hi"}',
                   timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the body is not valid UTF-16: byte 16: truncated data"
    for body, reason in ((b'{"max_tokens": ' + b"9" * 5000 + b"}", "integer string conversion"),
                         (b"[" * 100_000, "nest too deeply")):   # (QA 22: FastAPI's generic 400 before)
        r = httpx.post(f"http://{server.http}/v1/completions", content=body, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the body could not be read as JSON")
        assert reason in r.json()["error"]["message"], r.text
    r = httpx.post(f"http://{server.http}/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"http://{server.http}/v1/completions", content=b"", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "the body is empty" in r.json()["error"]["message"], r.text
    for body, content_type in ((b" \t\r\n", "application/json"), (b"", "APPLICATION/JSON")):   # (QA 21)
        r = httpx.post(f"http://{server.http}/v1/chat/completions", content=body, timeout=30,
                       headers={"content-type": content_type})
        assert r.status_code == 400 and "the body is empty" in r.json()["error"]["message"], r.text


def test_unknown_fields_are_served_as_vllm_does_and_named_in_the_log(server, smollm2_llm):
    """An unknown field (a misspelt ``max_token``) is ignored, as vLLM and OpenAI do, and its
    name is logged, so the request is not silently served at the default unnoticed."""
    r = httpx.post(f"http://{server.http}/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "max_token": 9, "zz_extra": {}})
    assert r.status_code == 200, r.text
    ref = smollm2_llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text     # served as without the extras
    assert r.json()["usage"]["completion_tokens"] == 3
    forged = "zz\n2099-01-01 00:00:00,000 CRITICAL trtllm_lite.serving: FORGED"
    r = httpx.post(f"http://{server.http}/tokenize", timeout=30,
                   json={"prompt": "Hi", "zz_tok_extra": 1, forged: 1, "y" * 100_000: 2})
    assert r.status_code == 200, r.text
    r = httpx.post(f"http://{server.http}/detokenize", json={"tokens": [1], **{f"f{i:04d}": i for i in range(100)}})
    assert r.status_code == 200, r.text
    r = httpx.post(f"http://{server.http}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 2, "stream": True, "stream_options": {"incude_usage": True}})
    assert r.status_code == 200, r.text
    r = httpx.post(f"http://{server.http}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi", "nmae": "ann"},
                     {"role": "user", "content": [{"type": "text", "text": "Hi", "txt": "x"}]}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    # a refused request's unknown fields are not logged: its error says what was wrong (QA 23)
    r = httpx.post(f"http://{server.http}/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "temperature": -1, "zz_refused": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = httpx.post(f"http://{server.http}/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "top_p": 2, "zz_refused_chat": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p", r.text
    for stream in (False, True):   # refused by the engine's own check as it is added (QA 24)
        r = httpx.post(f"http://{server.http}/v1/completions", timeout=60,
                       json={"prompt": [1000] * 1100, "stream": stream, "zz_refused_by_engine": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    # an image part is refused, and its fields are not named as ignored (QA 22)
    r = httpx.post(f"http://{server.http}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"], r.text
    r = httpx.post(f"http://{server.http}/tokenize", timeout=30, json={"prompt": "Hi", "zz_after_image": 1})
    assert r.status_code == 200, r.text
    wait_until(lambda: any("incude_usage" in line for line in server.stderr_lines), timeout=10)
    wait_until(lambda: any("nmae" in line for line in server.stderr_lines), timeout=10)
    # (a line logged after the image request's: that request's line, had there been one, is read)
    wait_until(lambda: any("zz_after_image" in line for line in server.stderr_lines), timeout=10)
    logged = [line for line in server.stderr_lines if "request fields ignored" in line]
    assert any("'max_token', 'zz_extra'" in line for line in logged), logged
    assert any("'stream_options.incude_usage'" in line for line in logged), logged
    assert any("'messages[0].nmae', 'messages[1].content[0].txt'" in line for line in logged), logged
    assert not any("content[0].image_url" in line for line in logged), logged
    assert not any("zz_refused" in line for line in logged), logged
    # (a client's newline cannot forge a log line; 100 KB of name and 100 fields give a short line)
    assert not any(line.startswith("2099-01-01") for line in server.stderr_lines)
    line = next(line for line in logged if "zz_tok_extra" in line)
    assert "\\n2099" in line and "'yyy" in line and len(line) < 500, line
    line = next(line for line in logged if "f0000" in line)
    assert "'f0015' and 84 more" in line and len(line) < 500, line


def test_form_body_is_400_naming_the_content_type(server):
    """`curl -d '{...}'` sends the JSON as a form: a 400 that says the body must be sent as
    application/json (pydantic's "valid dictionary" message did not say why; QA)."""
    r = httpx.post(f"http://{server.http}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}',
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 400, r.text
    assert "application/json" in r.json()["error"]["message"]
    assert "application/x-www-form-urlencoded" in r.json()["error"]["message"]


def test_body_over_max_message_bytes_is_413_with_or_without_a_length(server):
    """A body over the server's message limit (gRPC's --max-message-bytes, 16 MiB by default)
    is refused before it is parsed, whether it declares its length or comes chunked; the server
    answers afterwards."""
    big = b'{"model": "x", "prompt": "' + b"a" * (17 << 20) + b'"}'
    url = f"http://{server.http}/v1/completions"
    r = httpx.post(url, content=big, timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger than 16777216 bytes" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    chunked = httpx.post(url, content=iter([big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)]),
                         timeout=60, headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert httpx.get(f"http://{server.http}/health", timeout=30).status_code == 200


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_longer_than_any_max_seq_len_tokens_is_refused_untokenized(server, route):
    """10 MiB of text (under the body limit) is more characters than max_seq_len tokens can
    cover: refused by its length in characters, naming the field, not after tokenizing it
    (which took ~16 s of the event loop both servers share; found by QA)."""
    text = "a" * (10 << 20)
    body = ({"model": "smollm2", "prompt": text, "max_tokens": 2} if route == "completions" else
            {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    r = httpx.post(f"http://{server.http}/v1/{'completions' if route == 'completions' else 'chat/completions'}",
                   json=body, timeout=120)
    assert r.status_code == 400
    error = r.json()["error"]
    assert re.search(r"has 1048\d{4} characters: more than \d+ tokens can hold", error["message"])  # chat: + template
    assert error["param"] == ("prompt" if route == "completions" else "messages")


def test_chat_prompt_longer_than_max_seq_len_names_messages(server):
    """A chat request whose templated prompt, once tokenized, passes max_seq_len names
    ``messages`` (its field), not ``prompt``, which a chat request has none of (QA 27)."""
    r = httpx.post(f"http://{server.http}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hello world " * 1500}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert re.search(r"prompt has \d+ tokens, more than max_seq_len", error["message"]) and error["param"] == "messages"


def test_tokenize_of_text_longer_than_any_max_seq_len_tokens_is_refused_untokenized(server):
    """/tokenize bounds text like a prompt: 10 MiB is refused by its length in characters (it
    was tokenized on the event loop both servers share: ~25 s for 13 MB, every stream stalled;
    found by QA); text longer than max_seq_len tokens but within the bound is still counted."""
    r = httpx.post(f"http://{server.http}/tokenize", json={"prompt": "a" * (10 << 20)}, timeout=120)
    assert r.status_code == 400
    error = r.json()["error"]
    assert re.search(r"has 10485760 characters: more than \d+ tokens can hold", error["message"])
    assert error["param"] == "prompt"
    long = httpx.post(f"http://{server.http}/tokenize", json={"prompt": "hello world " * 1500}, timeout=120).json()
    assert long["count"] > long["max_model_len"]


def test_tokenize_with_both_prompt_and_messages_is_400_naming_both(server):
    """vLLM's /tokenize takes a prompt or messages; both were answered with the messages' tokens
    and the prompt silently dropped (QA)."""
    r = httpx.post(f"http://{server.http}/tokenize", json={"prompt": "Hello", "messages": MESSAGES}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "prompt" in error["message"] and "messages" in error["message"]
    assert httpx.post(f"http://{server.http}/tokenize", json={"prompt": "Hello", "messages": None},
                      timeout=30).json()["count"] > 0


def test_wrong_type_names_the_parameter_not_pydantic_internals(server):
    r = httpx.post(f"http://{server.http}/v1/completions", timeout=30,
                   json={"model": "smollm2", "prompt": "Hi", "stop": 5})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "stop" and err["message"].startswith("stop: ")
    r = httpx.post(f"http://{server.http}/v1/completions", timeout=30,
                   json={"model": "smollm2", "prompt": "Hi", "max_tokens": 10 ** 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("route, extra, param", [
    ("completions", {"max_tokens": True}, "max_tokens"),        # JSON true is not 1
    ("completions", {"temperature": True}, "temperature"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"prompt": [True, 2]}, "prompt"),
    ("chat/completions", {"n": True}, "n"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages"),   # no content
    ("chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages"),   # no parts (QA: was 200)
])
def test_wrong_json_types_are_400_not_coerced(server, route, extra, param):
    body = {"model": "smollm2", "max_tokens": 2, **({"prompt": "Hi"} if route == "completions" else
                                                   {"messages": [{"role": "user", "content": "Hi"}]}), **extra}
    r = httpx.post(f"http://{server.http}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_cache_salt_shares_prefix_blocks_only_within_a_salt(server):
    prompt = "Paged attention keeps the cache in fixed-size blocks shared between requests. " * 3
    url = f"http://{server.http}/v1/completions"

    def cached(**extra):
        r = httpx.post(url, timeout=60, json={"model": "smollm2", "prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") >= 16          # at least one full block reused
    assert cached(cache_salt="tenant-b") == 0           # another salt: nothing shared
    assert cached() == 0                                 # no salt is its own space


def test_unknown_route_and_wrong_method_use_the_openai_error_shape(server):
    missing = httpx.post(f"http://{server.http}/v1/embeddings", json={}, timeout=30)
    wrong = httpx.get(f"http://{server.http}/v1/completions", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert "/v1/embeddings" in missing.json()["error"]["message"]
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405
    assert wrong.json()["error"]["type"] == "invalid_request_error"


def test_models_health_metrics_tokenizer(server, smollm2_llm):
    base = f"http://{server.http}"
    models = httpx.get(f"{base}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "smollm2" and models["data"][0]["max_model_len"] == 1024
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    assert "trtllm_lite_time_to_first_token_seconds_count" in metrics
    tok = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert tok["tokens"] == smollm2_llm.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    chat_tok = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    text = smollm2_llm.tokenizer.apply_chat_template(MESSAGES, True)
    assert chat_tok["tokens"] == smollm2_llm.tokenizer.encode(text, add_special_tokens=False)
    detok = httpx.post(f"{base}/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json()
    assert detok["prompt"] == "Hello world"


def test_detokenize_of_more_ids_than_max_seq_len_is_400_naming_tokens(server):
    """/detokenize takes at most max_seq_len ids, as gRPC Detokenize (EngineService.detokenize):
    decoding holds the GIL on the event loop every stream shares, so a longer list is a 400
    naming tokens before it is read (any list up to the body size was decoded; QA)."""
    base = f"http://{server.http}"
    r = httpx.post(f"{base}/detokenize", json={"tokens": [11] * 200_000}, timeout=30)
    assert r.status_code == 400 and "tokens has 200000 token ids, more than max_seq_len 1024" in r.text
    r = httpx.post(f"{base}/detokenize", json={"tokens": [1, 10 ** 6]}, timeout=30)
    assert r.status_code == 400 and "tokens: 1000000 is outside the vocabulary" in r.text


def test_refused_http_requests_are_counted_like_grpc_ones(server):
    """Every generation request refused with 400/404 adds one invalid_argument outcome
    (docs/serving.md), whether pydantic, the model check, the parameters or the prompt
    refused it; a bad /tokenize call is not a generation request and adds none."""
    base = f"http://{server.http}"

    def refused():
        body = httpx.get(f"{base}/metrics", timeout=30).text
        line = next((x for x in body.splitlines()
                     if x.startswith('trtllm_lite_request_outcomes_total{outcome="invalid_argument"}')), None)
        return float(line.split(" ")[1]) if line else 0.0

    bad = [("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400),
           ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, 400),
           ("/v1/completions", {"prompt": PROMPT, "n": "a"}, 400),          # pydantic
           ("/v1/completions", {"prompt": PROMPT, "model": "nope"}, 404),
           ("/v1/completions", {"prompt": ""}, 400),                       # the engine's check
           ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 2}, 400)]
    before = refused()
    for path, body, status in bad:
        assert httpx.post(base + path, json=body, timeout=30).status_code == status, body
    assert httpx.post(f"{base}/tokenize", json={"prompt": 5}, timeout=30).status_code == 400
    assert refused() == before + len(bad)


def test_a_completions_batch_refused_by_one_prompt_counts_once(server, grpc_client):
    """A batch whose second prompt (or more than one) the engine refuses is one 400 and one invalid_argument
    outcome, streamed or not: the prompts the server ends with it are not counted as
    cancelled (the client cancelled nothing; they were counted so before: QA), nor as
    finished when the refused prompt took longer to tokenize than they took to finish (QA 15),
    and every KV block comes back."""
    base = f"http://{server.http}"

    def outcomes():
        body = httpx.get(f"{base}/metrics", timeout=30).text
        prefix = 'trtllm_lite_request_outcomes_total{outcome="'
        return {x[len(prefix):].split('"')[0]: float(x.split(" ")[1])
                for x in body.splitlines() if x.startswith(prefix)}

    import random

    rng = random.Random(2)
    slow = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(300_000))   # ~1 s to tokenize
    cases = [([[1, 2, 3] * 40, [1, 10 ** 6]], 64, "outside the vocabulary"),
             # refused after the first prompt has finished (held, then not counted as length)
             (["Hi", slow], 1, "more than max_seq_len"),
             # two refused prompts (token ids: each refused as its task first runs, before the
             # batch knows it failed): still one outcome (each was counted: QA 15b)
             ([[1, 10 ** 6], [1, 2, 3], [2, 10 ** 6]], 4, "outside the vocabulary")]
    for (prompts, max_tokens, message), stream in [(c, s) for c in cases for s in (False, True)]:
        before, tokens_before = outcomes(), token_counters(server)
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": prompts, "max_tokens": max_tokens, "stream": stream})
        assert r.status_code == 400 and message in r.text
        after = outcomes()
        delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        assert delta == {"invalid_argument": 1.0}, (stream, delta)
        assert wait_until(lambda: idle_blocks(grpc_client), 30)
        if prompts[0] == "Hi":   # the engine computed "Hi"'s token: it counts, answered or not (QA 24)
            tokens_after = token_counters(server)
            assert tokens_after[1] - tokens_before[1] == 1, (stream, tokens_before, tokens_after)


def test_grpc_and_http_share_one_engine(server, grpc_client, smollm2_llm):
    ref = smollm2_llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0.0))[0].outputs[0]
    got = {}

    def over_http():
        r = httpx.post(f"http://{server.http}/v1/completions", timeout=120,
                       json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 48, "temperature": 0})
        got["http"] = r.json()["choices"][0]["text"]

    def over_grpc():
        got["grpc"] = grpc_client.complete(PROMPT, max_tokens=48, temperature=0.0).outputs[0].text

    running = []
    threads = [threading.Thread(target=over_http), threading.Thread(target=over_grpc)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        running.append(grpc_client.model_info().num_running)
        time.sleep(0.02)
    assert got == {"http": ref.text, "grpc": ref.text}
    assert max(running) == 2                    # both requests in one engine's batch


def test_pool_smaller_than_max_seq_len_limits_max_model_len(smollm2_engine):
    """8 blocks of 16 tokens < max_seq_len 1024: /v1/models says 128 and a chat request without
    max_tokens gets the room left in the pool (it was a 400 about max_tokens, never sent), and
    one whose prompt alone fills the pool is a 400 naming its messages (it named max_tokens)."""
    args = [a for a in ENGINE_ARGS if a != "512"]
    args[args.index("--num-kv-blocks") + 1:args.index("--num-kv-blocks") + 1] = ["8"]
    with ServerProcess(smollm2_engine, *args) as s:
        with openai.OpenAI(base_url=f"http://{s.http}/v1", api_key="none", max_retries=0, timeout=120) as c:
            assert c.models.list().data[0].model_extra["max_model_len"] == 128
            r = c.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0)
            assert r.choices[0].message.content and r.usage.prompt_tokens + r.usage.completion_tokens <= 128
        body = {"model": "smollm2", "messages": MESSAGES, "max_completion_tokens": 120}
        r = httpx.post(f"http://{s.http}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
        assert "whole pool holds (8 x 16 tokens)" in r.json()["error"]["message"]   # the limit that binds
        long = [{"role": "user", "content": "hello " * 150}]          # ~150 tokens, no max_tokens sent
        r = httpx.post(f"http://{s.http}/v1/chat/completions", json={"model": "smollm2", "messages": long}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text   # its field (QA 27)
        assert "leaves no room for output: the whole pool holds 128 tokens" in r.json()["error"]["message"]
        assert s.stop() == 0


# -- API key, TLS, queue full, shutdown ----------------------------------------------------
@pytest.fixture(scope="module")
def secure(smollm2_engine, tls_files):
    cert, key = tls_files
    s = ServerProcess(smollm2_engine, *ENGINE_ARGS, "--max-num-seqs", "1", "--max-waiting-requests", "2",
                      "--tls-cert", cert, "--tls-key", key, "--shutdown-grace", "90",
                      env={"TRTLLM_LITE_API_KEY": "k3y"})
    yield s, cert
    s.kill()


def test_api_key_over_tls(secure):
    server, cert = secure
    url = f"https://{server.http}/v1/completions"
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
    with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=60) as h:
        r = h.post(url, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert h.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert h.get(f"https://{server.http}/health").status_code == 200        # stays open
        ok = h.post(url, json=body, headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        # the scheme is case-insensitive (RFC 7235 section 2.1); the key is not
        assert h.post(url, json=body, headers={"Authorization": "bearer k3y"}).status_code == 200
        assert h.post(url, json=body, headers={"Authorization": "Bearer  k3y"}).status_code == 200   # 1*SP
        assert h.post(url, json=body, headers={"Authorization": "Bearer K3Y"}).status_code == 401
        assert h.post(url, json=body, headers={"Authorization": "Basic k3y"}).status_code == 401
        # two Authorization headers are malformed (RFC 9110 section 5.3): the last one decided (QA 24)
        for pair in (["Bearer wrong", "Bearer k3y"], ["Bearer k3y", "Bearer k3y"]):
            assert h.post(url, json=body, headers=[("Authorization", v) for v in pair]).status_code == 401
    with openai.OpenAI(base_url=f"https://{server.http}/v1", api_key="k3y", max_retries=0,
                       http_client=httpx.Client(verify=ssl.create_default_context(cafile=cert))) as c:
        assert c.models.list().data[0].id == "smollm2"
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://{server.http}/v1/completions", json=body, timeout=10)   # plaintext to a TLS port


def test_queue_full_is_429(secure):
    server, cert = secure
    url = f"https://{server.http}/v1/completions"
    long = {"model": "smollm2", "prompt": "Write an essay.", "max_tokens": 40, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=cert), timeout=120, headers={"Authorization": "Bearer k3y"}) as h:
            return await asyncio.gather(*[h.post(url, json=long) for _ in range(4)])

    answers = asyncio.run(burst())
    statuses = sorted(r.status_code for r in answers)
    assert statuses[0] == 200 and statuses[-1] == 429 and set(statuses) == {200, 429}
    # "waiting queue is full ...": no parameter is at fault (param was "waiting")
    assert all(r.json()["error"]["param"] is None for r in answers if r.status_code == 429)
    with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=60, headers={"Authorization": "Bearer k3y"}) as h:
        r = h.post(url, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


def test_a_batch_with_too_little_room_in_the_queue_is_429_and_queues_nothing(secure):
    """One request running and one waiting (max_waiting_requests 2): a batch of two prompts is
    a 429 before either is queued, counted once as resource_exhausted. Before, the prompt that
    fit was queued (a place other clients were refused meanwhile), then ended with the batch
    and counted as cancelled (QA)."""
    server, cert = secure
    base = f"https://{server.http}"
    long = {"model": "smollm2", "prompt": "Write an essay.", "max_tokens": 60, "ignore_eos": True}

    def outcomes(h):
        prefix = 'trtllm_lite_request_outcomes_total{outcome="'
        return {x[len(prefix):].split('"')[0]: float(x.split(" ")[1])
                for x in h.get(f"{base}/metrics").text.splitlines() if x.startswith(prefix)}

    async def run():
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=cert), timeout=120,
                                     headers={"Authorization": "Bearer k3y"}) as h:
            first = asyncio.ensure_future(h.post(f"{base}/v1/completions", json=long))
            second = asyncio.ensure_future(h.post(f"{base}/v1/completions", json=long))
            while "trtllm_lite_num_requests_waiting 1.0" not in (await h.get(f"{base}/metrics")).text:
                await asyncio.sleep(0.05)
            batch = await h.post(f"{base}/v1/completions", json={**long, "prompt": ["a", "b"]})
            waiting = (await h.get(f"{base}/metrics")).text
            await asyncio.gather(first, second)
            return batch, waiting

    with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=60,
                      headers={"Authorization": "Bearer k3y"}) as h:
        before = outcomes(h)
        batch, waiting = asyncio.run(run())
        after = outcomes(h)
    assert batch.status_code == 429 and "room for 1 requests, and prompt has 2 prompts" in batch.text
    assert "trtllm_lite_num_requests_waiting 1.0" in waiting
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert delta == {"resource_exhausted": 1.0, "length": 2.0}, delta


def test_shutdown_finishes_in_flight_and_refuses_new_with_503(secure):
    server, cert = secure
    url = f"https://{server.http}/v1/completions"
    headers = {"Authorization": "Bearer k3y"}
    done = {}

    def in_flight():
        with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=120, headers=headers) as h:
            with h.stream("POST", url, json={"model": "smollm2", "prompt": "Count.", "max_tokens": 160,
                                             "ignore_eos": True, "stream": True}) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        done["finish"] = chunks[-1]["choices"][0]["finish_reason"]
        done["last"] = events[-1]

    t = threading.Thread(target=in_flight)
    with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=30, headers=headers) as h:
        t.start()
        assert wait_until(lambda: h.get(f"https://{server.http}/metrics").text.find(
            "trtllm_lite_num_requests_running 1.0") >= 0, timeout=60)
        server.signal()
        # the in-flight request (160 tokens) outlasts this on any machine; poll, don't sleep
        assert wait_until(lambda: h.get(f"https://{server.http}/health").status_code == 503, timeout=10)
        refused = h.post(url, json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
        health = h.get(f"https://{server.http}/health")
    t.join(120)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
    assert health.status_code == 503
    assert done == {"finish": "length", "last": "data: [DONE]"}
    assert server.wait(60) == 0


def test_a_long_tokenize_answer_does_not_hold_the_event_loop(smollm2_engine):
    """/tokenize of text within the character limit may answer ~1.8M token ids: the answer is
    encoded on a worker thread (FastAPI's jsonable_encoder held the event loop ~5 s on them, every
    stream and /health waited, after the tokenizing itself had been moved off it; QA 15)."""
    import random

    from trtllm_lite.async_llm import AsyncLLM
    from trtllm_lite.serving.engine_service import EngineService
    from trtllm_lite.serving.http import OpenAIServer
    from trtllm_lite.serving.metrics import Metrics

    rng = random.Random(0)
    llm = AsyncLLM(smollm2_engine, num_threads=2, num_kv_blocks=64)
    limit = llm.engine.scheduler_config.max_seq_len * llm.tokenizer.max_chars_per_token
    text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(limit - 10))
    app = OpenAIServer(EngineService(llm, "m", Metrics())).app
    try:
        async def run():
            async with loop_gaps() as gaps:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                    start = time.perf_counter()
                    r = await c.post("/tokenize", json={"prompt": text}, timeout=120)
                    took = time.perf_counter() - start
            return r, max(gaps), took

        r, longest, took = asyncio.run(run())
        assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 500_000
        assert longest < took / 4, (longest, took)
    finally:
        llm.shutdown()


def test_null_fields_take_their_defaults(server):
    """``null`` for n, stream, echo, a chat's logprobs and stream_options' flags is their
    default, as OpenAI's and vLLM's servers take it (QA, session 42: a 400 each)."""
    base = f"http://{server.http}"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": None, "n": None,
                                                   "echo": None}, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and not r.json()["choices"][0]["text"].startswith("Hi")
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "logprobs": None,
                                                        "n": None, "add_generation_prompt": None}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    with httpx.stream("POST", f"{base}/v1/completions", json={
            "prompt": "Hi", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": None, "continuous_usage_stats": None}}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert all('"usage"' not in line or '"usage":null' in line.replace(" ", "") for line in lines)


def test_request_checks_found_by_qa_42(server, smollm2_llm):
    """/tokenize checks chat messages as the chat route does; /detokenize keeps special tokens
    (vLLM's), or skips them when asked; response_format needs its type; min_tokens past the
    max names the field sent; a text/json body is told its Content-Type."""
    base = f"http://{server.http}"
    for route, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 2})):
        r = httpx.post(f"{base}{route}", json={"messages": [{"role": "user"}], **extra}, timeout=60)
        assert r.status_code == 400 and "message 0 (role 'user') has no content" in r.json()["error"]["message"]
    ids = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    text = httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert text == smollm2_llm.tokenizer.decode(ids, skip_special_tokens=False) and text.startswith("<|im_start|>")
    plain = httpx.post(f"{base}/detokenize", json={"tokens": ids, "skip_special_tokens": True}, timeout=60).json()
    assert "<|im_start|>" not in plain["prompt"]
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                        "response_format": {}}, timeout=60)
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": 2,
                                                        "min_tokens": 5}, timeout=60)
    assert r.status_code == 400 and "min_tokens (5) exceeds max_completion_tokens (2)" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 0, "echo": True, "min_tokens": 1},
                   timeout=60)
    assert r.status_code == 400 and "min_tokens (1) exceeds max_tokens (0)" in r.json()["error"]["message"]
    # min_tokens past a max_tokens the client did not send names the one in effect (QA, session 42)
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "min_tokens": 20}, timeout=60)
    assert r.status_code == 400 and "min_tokens (20) exceeds max_tokens (16, the default)" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "min_tokens": 2000}, timeout=60)
    assert r.status_code == 400 and re.search(r"min_tokens \(2000\) exceeds the \d+ tokens left after the prompt",
                                              r.json()["error"]["message"])
    # an empty stream_options asks for nothing (vLLM takes it without stream); null flags on the
    # tokenizer routes are their defaults too
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream_options": {}},
                      timeout=60).status_code == 200
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                   "stream_options": {"include_usage": True}}, timeout=60)
    assert r.status_code == 400 and "stream_options is only allowed with stream=true" in r.json()["error"]["message"]
    nulls = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": None,
                                                 "add_special_tokens": None}, timeout=60).json()["tokens"]
    assert nulls == ids
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids, "skip_special_tokens": None},
                      timeout=60).json()["prompt"] == text
    r = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}',
                   headers={"Content-Type": "text/json"}, timeout=60)
    assert r.status_code == 400 and "Content-Type here: text/json" in r.json()["error"]["message"]
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code == 200
