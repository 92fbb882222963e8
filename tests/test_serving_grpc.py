"""The gRPC service (``trtllm_lite.v1.LLMService``, health, reflection, limits, security,
shutdown) against real server processes on 127.0.0.1: the SmolLM2 engine for generation,
a tiny engine where only the plumbing matters. References: ``LLM.generate`` in this process."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from trtllm_lite import SamplingParams
from trtllm_lite.serving.client import AsyncLLMClient, LLMClient
from trtllm_lite.serving.process import ServerProcess, self_signed_cert, wait_until

pytestmark = pytest.mark.timeout(300)

ENGINE_ARGS = ("--num-threads", "2", "--no-verify-checksums", "--num-kv-blocks", "512")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The best way to learn", "Water boils at", "import numpy as", "My favourite colour is"]


@pytest.fixture(scope="module")
def server(smollm2_engine):
    with ServerProcess(smollm2_engine, *ENGINE_ARGS) as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with LLMClient(server.grpc, timeout=120) as c:
        yield c


def idle_blocks(client) -> bool:
    info = client.model_info()
    return info.kv_blocks_used == 0 and info.num_running == 0 and info.num_waiting == 0


def greedy(max_tokens):
    return dict(max_tokens=max_tokens, temperature=0.0)


def joined(responses):
    text, ids = "", []
    for r in responses:
        for o in r.outputs:
            text += o.text
            ids += list(o.token_ids)
    return text, ids


# -- stubs ---------------------------------------------------------------------------------
def test_committed_stubs_match_proto():
    from trtllm_lite.serving import protos
    from trtllm_lite.serving.protos import generate

    here = os.path.dirname(protos.__file__)
    with open(os.path.join(here, "llm_service.proto"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(here, "PROTO_SHA256")) as f:
        assert f.read().strip() == digest, "llm_service.proto changed: run python -m trtllm_lite.serving.protos.generate"
    if importlib.util.find_spec("grpc_tools") is not None:
        assert generate.main(["--check"]) == 0


# -- generation ----------------------------------------------------------------------------
def test_stream_equals_unary_equals_llm(client, smollm2_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = smollm2_llm.chat(messages, SamplingParams(**greedy(16)))[0].outputs[0]
    responses = list(client.generate(messages=messages, **greedy(16)))
    text, ids = joined(responses)
    final = client.complete(messages=messages, **greedy(16))
    assert ids == list(final.outputs[0].token_ids) == ref.token_ids
    assert text == final.outputs[0].text == ref.text
    assert "Paris" in text
    last = responses[-1]
    assert last.finished and last.outputs[0].finish_reason == ref.finish_reason == "stop"
    assert all(not r.finished for r in responses[:-1])
    assert last.usage.prompt_tokens == len(responses[0].prompt_token_ids) > 0
    assert last.usage.completion_tokens == len(ids)
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (last.usage.prompt_tokens, len(ids))
    assert final.usage.cached_tokens >= 16     # the second time, full prompt blocks come from the prefix cache
    assert 0 < last.timing.ttft_ms <= last.timing.e2e_ms


def test_cache_salt_isolates_prefix_cache(client):
    prompt = "A salted prompt: blocks of the prefix cache are shared only within one salt. " * 3
    cached = lambda **kw: client.complete(prompt, max_tokens=1, **kw).usage.cached_tokens  # noqa: E731
    cached(cache_salt="grpc-a")
    assert cached(cache_salt="grpc-a") >= 16 and cached(cache_salt="grpc-b") == 0
    with pytest.raises(grpc.RpcError) as e:
        cached(cache_salt="")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()


def test_token_id_prompt_and_length_finish(client, smollm2_llm):
    ids = smollm2_llm.tokenizer.encode("Once upon a time")
    ref = smollm2_llm.generate(ids, SamplingParams(**greedy(5)))[0].outputs[0]
    out = client.complete(ids, **greedy(5)).outputs[0]
    assert list(out.token_ids) == ref.token_ids and out.finish_reason == "length"


def test_32_concurrent_streams_match_each_alone(server, smollm2_llm):
    params = SamplingParams(**greedy(8))
    alone = {p: smollm2_llm.generate(p, params)[0].outputs[0] for p in PROMPTS}

    async def run_all():
        async with AsyncLLMClient(server.grpc, timeout=240) as c:
            async def one(prompt):
                text, ids = "", []
                async for r in c.generate(prompt, **greedy(8)):
                    text += "".join(o.text for o in r.outputs)
                    ids += [t for o in r.outputs for t in o.token_ids]
                return prompt, text, ids
            return await asyncio.gather(*[one(p) for p in PROMPTS * 4])

    results = asyncio.run(run_all())
    assert len(results) == 32
    for prompt, text, ids in results:
        assert ids == alone[prompt].token_ids, prompt
        assert text == alone[prompt].text, prompt


# -- cancellation and abort ----------------------------------------------------------------
def test_cancel_mid_stream_frees_blocks(client):
    assert wait_until(lambda: idle_blocks(client))
    stream = client.generate("Tell me a long story about a dragon.", max_tokens=400, ignore_eos=True)
    for _ in range(3):
        next(stream)
    assert client.model_info().kv_blocks_used > 0
    stream.close()   # cancels the call
    assert wait_until(lambda: idle_blocks(client), timeout=10)
    assert client.complete("Hi", max_tokens=2).finished


def test_50_cancellations_leak_nothing(client):
    from trtllm_lite.serving.client import make_request

    for i in range(50):
        if i % 3:           # mid-stream, after the first delta
            stream = client.generate(f"Count to one hundred: {i}", max_tokens=300, ignore_eos=True)
            next(stream)
            stream.close()
        else:               # before any response: waiting or in prefill
            call = client.stub.Generate(make_request(f"Count to ten: {i}", max_tokens=300, ignore_eos=True))
            time.sleep(0.01 * (i % 4))
            call.cancel()
    assert wait_until(lambda: idle_blocks(client), timeout=15)
    info = client.model_info()
    assert info.kv_blocks_free == info.num_kv_blocks
    assert client.complete("Hi", max_tokens=2).finished


def running_stream(client, request_id: str, max_tokens: int) -> tuple[threading.Thread, list]:
    """An essay streamed by ``client`` on a thread, returned once the server runs it: (the
    thread, the list its responses go to)."""
    got = []
    t = threading.Thread(target=lambda: got.extend(client.generate(
        "Write an essay.", request_id=request_id, max_tokens=max_tokens, ignore_eos=True)))
    t.start()
    assert wait_until(lambda: client.model_info().num_running == 1, timeout=30)
    return t, got


def test_abort_by_request_id_is_idempotent(server, client):
    t, got = running_stream(client, "essay-1", 400)
    assert client.abort("essay-1") is True
    assert client.abort("essay-1") is False          # its abort is already under way
    t.join(30)
    assert got and got[-1].finished and got[-1].outputs[0].finish_reason == "abort"
    assert client.abort("essay-1") is False          # already finished
    assert client.abort("no-such-request") is False
    assert wait_until(lambda: idle_blocks(client))


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt="Hi", temperature=-1.0), "temperature"),
    (dict(prompt="Hi", top_p=2.0), "top_p"),
    (dict(prompt="Hi", max_tokens=0), "max_tokens"),
    (dict(prompt="Hi", seed=-3), "seed"),
    (dict(prompt="Hi", stop_token_ids=[10 ** 6]), "stop_token_ids"),
    (dict(prompt=[1, 2, 10 ** 6]), "vocabulary"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[1] * 1500), "1024"),                        # longer than max_seq_len
    (dict(prompt=[1] * 1000, max_tokens=100), "max_seq_len"),
    (dict(messages=[{"role": "user", "content": "Hi"}], n=0), "n"),
])
def test_bad_requests_are_invalid_argument(client, kwargs, field):
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(grpc.RpcError) as e:
        client.complete(prompt, **kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_seed_error_gives_the_int64_fields_range(client):
    """The proto's seed is an int64: a negative one is INVALID_ARGUMENT naming seed and the
    range a gRPC client can send, [0, 2**63) (it said uint64 and [0, 2**64); QA); the top of
    that range is a valid seed."""
    with pytest.raises(grpc.RpcError) as e:
        client.complete("Hi", max_tokens=1, seed=-3)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("seed must be an integer in [0, 2**63)") and "uint64" not in e.value.details()
    assert "int64" in e.value.details() and e.value.details().endswith("got -3")
    assert client.complete("Hi", max_tokens=1, seed=2 ** 63 - 1).finished


def test_a_request_id_in_use_is_already_exists(server, client):
    """A second request with the id of a running one: ALREADY_EXISTS naming the id (it was
    INVALID_ARGUMENT; QA 20), counted as already_exists; the running one goes on unharmed."""
    t, got = running_stream(client, "dup-1", 60)
    with pytest.raises(grpc.RpcError) as e:
        client.complete("Hi", request_id="dup-1", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "'dup-1' is already in use" in e.value.details()
    t.join(60)
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "length"
    metrics = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=30).read().decode()
    assert 'trtllm_lite_request_outcomes_total{outcome="already_exists"} 1.0' in metrics
    assert wait_until(lambda: idle_blocks(client))


@pytest.mark.parametrize("kwargs,named", [(dict(max_tokens=2 ** 31), "max_tokens=2147483648"),
                                          (dict(temperature="hot"), "temperature='hot'"),
                                          (dict(stop=[1, 2]), "stop=[1, 2]")])
def test_client_names_a_value_its_message_cannot_hold(client, kwargs, named):
    """A value the request message cannot carry (past int32, a string for a float): the
    client's ValueError names the parameter (protobuf's own says only "Value out of range";
    QA 19), before anything is sent; the client goes on."""
    with pytest.raises(ValueError, match=r"sampling parameter " + re.escape(named)):
        client.complete("Hi", **kwargs)
    assert client.complete("Hi", max_tokens=1).finished


def test_missing_prompt_is_invalid_argument(client):
    from trtllm_lite.serving.protos import llm_service_pb2 as pb

    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(pb.GenerateRequest(stream=True)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()


def test_undecodable_request_is_invalid_argument(server, client):
    """Bytes that are not a message of the method (unary, server-streaming, KServe's unary and
    bidirectional stream) get INVALID_ARGUMENT naming the method, not grpcio's UNKNOWN; the
    server goes on serving."""
    garbage = b"\xff\xff\xff\xff\x0f not a protobuf"
    with grpc.insecure_channel(server.grpc) as channel:
        calls = {"/trtllm_lite.v1.LLMService/GetModelInfo": lambda m: channel.unary_unary(m)(garbage, timeout=30),
                 "/trtllm_lite.v1.LLMService/Generate": lambda m: list(channel.unary_stream(m)(garbage, timeout=30)),
                 "/inference.GRPCInferenceService/ModelInfer": lambda m: channel.unary_unary(m)(garbage, timeout=30),
                 "/inference.GRPCInferenceService/ModelStreamInfer":
                     lambda m: list(channel.stream_stream(m)(iter([garbage]), timeout=30))}
        for method, call in calls.items():
            with pytest.raises(grpc.RpcError) as e:
                call(method)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert method in e.value.details()
        # a string field (GenerateRequest.text, field 2) that is not UTF-8: the message says it may be
        with pytest.raises(grpc.RpcError) as e:
            list(channel.unary_stream("/trtllm_lite.v1.LLMService/Generate")(b"\x12\x02\xff\xfe", timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid UTF-8" in e.value.details()
    assert client.complete("The capital of France is", max_tokens=2).finished


def test_deadline_exceeded_aborts_request(client):
    with pytest.raises(grpc.RpcError) as e:
        client.complete("Write a poem.", max_tokens=400, ignore_eos=True, timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: idle_blocks(client), timeout=10)
    assert client.complete("Hi", max_tokens=3).outputs[0].finish_reason in ("stop", "length")


def outcomes(server) -> dict[str, float]:
    """``trtllm_lite_request_outcomes_total`` by outcome, as the server's /metrics has it now."""
    prefix = 'trtllm_lite_request_outcomes_total{outcome="'
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {line[len(prefix):line.index('"}')]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith(prefix)}


def test_deadline_exceeded_is_counted_as_such_not_as_cancelled(server, client):
    """A call whose deadline passes counts under outcome deadline_exceeded. gRPC cancels the
    handler at the deadline just as the request's own timer fires; whichever came first
    decided the count, and it was mostly cancelled (7 of 10; QA)."""
    before = outcomes(server)
    for timeout in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        with pytest.raises(grpc.RpcError) as e:
            client.complete("Write a poem.", max_tokens=400, ignore_eos=True, timeout=timeout)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    delta = lambda name: outcomes(server).get(name, 0) - before.get(name, 0)  # noqa: E731
    assert wait_until(lambda: delta("deadline_exceeded") + delta("cancelled") >= 6, timeout=10)
    assert (delta("deadline_exceeded"), delta("cancelled")) == (6, 0)
    assert wait_until(lambda: idle_blocks(client), timeout=10)


def test_a_deadline_while_a_chat_is_tokenized_is_counted(server, client):
    """A chat's template is tokenized before the request reaches the engine (on the tokenizing
    threads); a deadline that passes meanwhile is DEADLINE_EXCEEDED and counted once as such.
    It was not counted at all (QA 15), nor a KServe request's (counted invalid_argument)."""
    import random

    rng = random.Random(1)
    text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(300_000))   # ~1 s to tokenize
    before = outcomes(server)
    with pytest.raises(grpc.RpcError) as e:
        client.complete(messages=[{"role": "user", "content": text}], max_tokens=4, timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    delta = lambda: {k: v - before.get(k, 0) for k, v in outcomes(server).items() if v != before.get(k, 0)}  # noqa: E731
    assert wait_until(lambda: delta(), timeout=10)
    time.sleep(2.0)   # the tokenizing thread finishes and refuses the prompt: nothing more is counted
    assert delta() == {"deadline_exceeded": 1.0}
    assert wait_until(lambda: idle_blocks(client), timeout=10)


# -- model info, tokenizer, health, reflection, metrics ----------------------------------------
def test_model_info_and_tokenizer(client, smollm2_llm):
    info = client.model_info()
    assert info.model_name == "smollm2" and info.num_layers == 30 and info.num_kv_heads == 3
    assert info.max_seq_len == 1024 and info.block_size == 16 and info.num_kv_blocks == 512
    assert info.kv_blocks_used + info.kv_blocks_free == info.num_kv_blocks
    text = "Hello, world! Ünïcödé"
    ids = client.tokenize(text)
    assert ids == smollm2_llm.tokenizer.encode(text)
    assert client.detokenize(ids) == smollm2_llm.tokenizer.decode(ids) == text


def test_async_client_has_the_blocking_clients_methods(server, smollm2_llm):
    """The docs say so; tokenize, detokenize and health were missing (QA)."""
    public = {n for n in dir(LLMClient) if not n.startswith("_")}
    assert public <= {n for n in dir(AsyncLLMClient) if not n.startswith("_")}

    async def run():
        async with AsyncLLMClient(server.grpc, timeout=60) as c:
            ids = await c.tokenize("Hello, world!")
            return ids, await c.detokenize(ids), await c.health(), (await c.model_info()).model_name

    ids, text, health, name = asyncio.run(run())
    assert ids == smollm2_llm.tokenizer.encode("Hello, world!") and text == "Hello, world!"
    assert (health, name) == ("SERVING", "smollm2")


def test_tokenize_of_text_longer_than_any_max_seq_len_tokens_is_refused_untokenized(client):
    """Tokenize bounds text like Generate's prompt: 10 MiB is INVALID_ARGUMENT by its length in
    characters, not tokenized on the server's event loop (~25 s for 13 MB, every other request
    stalled; found by QA)."""
    with pytest.raises(grpc.RpcError) as e:
        client.tokenize("a" * (10 << 20))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has 10485760 characters: more than" in e.value.details()
    assert len(client.tokenize("hello world " * 1500)) > client.model_info().max_seq_len


def test_detokenize_of_more_ids_than_max_seq_len_is_refused_undecoded(client, smollm2_llm):
    """Detokenize takes at most max_seq_len ids, the longest sequence the engine holds: decoding
    holds the GIL on the event loop every stream shares (3M ids stalled them all 2.7 s; QA), so
    a longer list is INVALID_ARGUMENT naming token_ids before it is read; max_seq_len ids decode."""
    with pytest.raises(grpc.RpcError) as e:
        client.detokenize([11] * 1_000_000)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids has 1000000 token ids, more than max_seq_len 1024" in e.value.details()
    ids = smollm2_llm.tokenizer.encode("hello world " * 600)[:1024]
    assert len(ids) == 1024 and client.detokenize(ids) == smollm2_llm.tokenizer.decode(ids)
    with pytest.raises(grpc.RpcError) as e:
        client.detokenize([1, 10 ** 6])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids: 1000000 is outside" in e.value.details()


def test_tokenize_without_input_is_invalid_argument(client):
    """A TokenizeRequest with neither text nor chat is INVALID_ARGUMENT (it answered an empty
    token list; Generate without a prompt and HTTP /tokenize without one are refused; QA); an
    explicitly empty text is still tokenized."""
    from trtllm_lite.serving.protos import llm_service_pb2 as pb

    with pytest.raises(grpc.RpcError) as e:
        client.stub.Tokenize(pb.TokenizeRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "set text or chat" in e.value.details()
    assert list(client.stub.Tokenize(pb.TokenizeRequest(text="", add_special_tokens=False), timeout=30).token_ids) == []


def test_health_and_reflection(server, client):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    assert client.health() == "SERVING"
    assert client.health("trtllm_lite.v1.LLMService") == "SERVING"
    services = set(ProtoReflectionDescriptorDatabase(client.channel).get_services())
    assert {"trtllm_lite.v1.LLMService", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services


def test_metrics_over_http(server, client):
    client.complete("Hi", max_tokens=3)
    with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10) as r:
        body = r.read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
              if line.startswith("trtllm_lite_") and " " in line}
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "time_per_output_token_seconds_count", "inter_token_latency_seconds_count",
                 "request_queue_time_seconds_count", "prompt_tokens_total", "generation_tokens_total"):
        assert values["trtllm_lite_" + name] > 0, name
    assert values['trtllm_lite_request_outcomes_total{outcome="length"}'] >= 1
    assert values['trtllm_lite_request_outcomes_total{outcome="invalid_argument"}'] >= 1
    assert values['trtllm_lite_request_outcomes_total{outcome="cancelled"}'] >= 1
    assert values["trtllm_lite_kv_cache_blocks_total"] == 512
    assert "trtllm_lite_num_requests_running" in values and "trtllm_lite_kv_cache_usage_ratio" in values


def test_client_cli_streams_the_answer(server, smollm2_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = smollm2_llm.chat(messages, SamplingParams(**greedy(12)))[0].outputs[0].text
    out = subprocess.run([sys.executable, "-m", "trtllm_lite.cli", "client", "--server", server.grpc, "--chat",
                          "--prompt", messages[0]["content"], "--stream", "--max-tokens", "12"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ref + "\n"


def test_client_cli_exits_1_and_says_so_when_its_request_is_aborted(server, client):
    """A streamed answer cut short by the server (here an abort by the request's id; a shutdown
    ends streams the same way) is not a success: exit status 1 and a line on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "trtllm_lite.cli", "client", "--server", server.grpc,
                             "--prompt", "Write a long essay about the sea.", "--stream", "--max-tokens", "400",
                             "--request-id", "cli-abort-1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not client.abort("cli-abort-1"):    # False until the server has the request
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the request never arrived"
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, (out, err)
    assert "aborted the request" in err


# -- limits, security, shutdown (tiny engine: only the plumbing matters) ---------------------
@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    try:
        return self_signed_cert(str(tmp_path_factory.mktemp("tls")))
    except FileNotFoundError:
        pytest.skip("openssl is needed to make a self-signed certificate")


@pytest.fixture(scope="module")
def tiny_server(tiny_model, tls_files):
    _, engine = tiny_model("llama-gqa")
    cert, key = tls_files
    with ServerProcess(engine, "--num-threads", "1", "--max-num-seqs", "1", "--max-waiting-requests", "1",
                       "--max-message-bytes", "65536", "--tls-cert", cert, "--tls-key", key,
                       env={"TRTLLM_LITE_API_KEY": "s3cret"}) as s:
        yield s, cert
        assert s.stop() == 0


@pytest.mark.parametrize("key", ["k\udcff", "k y", "k\u00e9y", "k\t", "\x7f", ""])
def test_an_api_key_no_client_could_send_is_refused_at_start(key):
    """gRPC metadata carries printable ASCII only: a key read from the environment with a byte
    that is not UTF-8 (a surrogate-escaped str) failed every protected call with a 500 / UNKNOWN
    (QA 24), and a non-ASCII one could never be sent; an empty one (``--api-key "$UNSET"``)
    served everyone. The server refuses such a key at start."""
    from trtllm_lite.serving.server import ServerConfig

    with pytest.raises(ValueError, match="api_key must be printable ASCII"):
        ServerConfig(engine_dir="engines/x", api_key=key)
    assert ServerConfig(engine_dir="engines/x", api_key="s3cret-K_~!").api_key == "s3cret-K_~!"


def test_tls_files_are_checked_at_start_naming_the_flags(tls_files, tmp_path):
    """A missing key file failed with a bare errno, and a garbage or mismatched pair as a port
    that could not be bound (QA)."""
    from trtllm_lite.serving.server import ServerConfig

    cert, key = tls_files
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match=r"tls_key \(--tls-key\) '/nonexistent.key': no such file"):
        ServerConfig(engine_dir="engines/x", tls_cert=cert, tls_key="/nonexistent.key")
    for pair in ((str(garbage), key), (cert, str(garbage)), (key, cert)):
        with pytest.raises(ValueError, match="--tls-cert, --tls-key.*not a PEM certificate chain"):
            ServerConfig(engine_dir="engines/x", tls_cert=pair[0], tls_key=pair[1])
    assert ServerConfig(engine_dir="engines/x", tls_cert=cert, tls_key=key).tls_cert == cert
    # an encrypted key: OpenSSL prompted for its passphrase on the terminal and the start hung (QA)
    encrypted = tmp_path / "encrypted.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:secret", "-out", str(encrypted)],
                   check=True, capture_output=True)
    with pytest.raises(ValueError, match=r"tls_key \(--tls-key\) is encrypted"):
        ServerConfig(engine_dir="engines/x", tls_cert=cert, tls_key=str(encrypted))


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-waiting-requests", "0"], "argument --max-waiting-requests: must be an integer >= 1"),
    (["serve", "--served-model-name", ""], "argument --served-model-name: must not be empty"),
    (["serve", "--num-threads", "0"], "argument --num-threads: must be an integer >= 1"),
    (["serve", "--request-timeout", "0"], "argument --request-timeout: must be a finite number > 0"),
    (["serve", "--max-message-bytes", "99999999999999"], "argument --max-message-bytes: must be an integer >= 1024 and <="),
    (["serve", "--log-level", "LOUD"], "argument --log-level: invalid choice"),
    (["client", "--prompt", "x", "--timeout", "-1"], "argument --timeout: must be a finite number > 0"),
])
def test_cli_flags_out_of_range_are_named(argv, message, capsys):
    """These were accepted (QA): --max-waiting-requests 0 refused every request of an idle
    server, a timeout of -1 s was sent, an empty model name was served."""
    from trtllm_lite.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv[:1] + (["--engine", "engines/x"] if argv[0] == "serve" else []) + argv[1:])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_api_key_and_tls(tiny_server, tiny_model):
    server, cert = tiny_server
    hf, _ = tiny_model("llama-gqa")
    with LLMClient(server.grpc, tls_root_cert=cert, timeout=30) as anonymous:
        with pytest.raises(grpc.RpcError) as e:
            anonymous.complete([1, 2, 3], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            anonymous.model_info()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert anonymous.health() == "SERVING"          # health stays open
        # the Bearer scheme is case-insensitive (RFC 7235 section 2.1); the key is not
        from trtllm_lite.serving.protos import llm_service_pb2 as pb

        assert anonymous.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                                           metadata=(("authorization", "bearer s3cret"),)).max_seq_len > 0
        with pytest.raises(grpc.RpcError) as e:
            anonymous.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                                        metadata=(("authorization", "Bearer S3CRET"),))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # one authorization entry, as HTTP takes one header (a second one decided before: QA 24)
        with pytest.raises(grpc.RpcError) as e:
            anonymous.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=(
                ("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with LLMClient(server.grpc, tls_root_cert=cert, api_key="wrong", timeout=30) as wrong:
        with pytest.raises(grpc.RpcError) as e:
            wrong.complete([1, 2, 3], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with LLMClient(server.grpc, api_key="s3cret", timeout=5) as plaintext:
        with pytest.raises(grpc.RpcError) as e:
            plaintext.complete([1, 2, 3], max_tokens=2)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with LLMClient(server.grpc, tls_root_cert=cert, api_key="s3cret", timeout=30) as c:
        out = c.complete([1, 2, 3], max_tokens=4, temperature=0.0).outputs[0]
        import torch

        with torch.no_grad():
            ref = hf.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)[0, 3:].tolist()
        assert list(out.token_ids) == ref


def test_queue_full_is_resource_exhausted(tiny_server):
    server, cert = tiny_server

    async def burst():
        async with AsyncLLMClient(server.grpc, tls_root_cert=cert, api_key="s3cret", timeout=60) as c:
            async def one(i):
                try:
                    r = await c.complete([1, 2, 3 + i], max_tokens=240, ignore_eos=True)
                    return r.outputs[0].finish_reason
                except grpc.RpcError as e:
                    return e.code()
            return await asyncio.gather(*[one(i) for i in range(8)])

    outcomes = asyncio.run(burst())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in outcomes
    assert "length" in outcomes
    assert set(outcomes) <= {"length", grpc.StatusCode.RESOURCE_EXHAUSTED}
    with LLMClient(server.grpc, tls_root_cert=cert, api_key="s3cret", timeout=30) as c:
        assert c.complete([1, 2], max_tokens=2).finished
        assert wait_until(lambda: idle_blocks(c))


def test_message_size_limit(tiny_server):
    server, cert = tiny_server
    with LLMClient(server.grpc, tls_root_cert=cert, api_key="s3cret", timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete([200] * 40000, max_tokens=2)    # 2 bytes per id: ~80 KB > 64 KiB
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.complete([1, 2], max_tokens=2).finished


def test_graceful_shutdown(smollm2_engine):
    server = ServerProcess(smollm2_engine, *ENGINE_ARGS, "--shutdown-grace", "4", metrics=False)
    results = {}
    try:
        with LLMClient(server.grpc, timeout=120) as c:
            def consume(name, **kw):
                try:
                    results[name] = list(c.generate("Tell me about the sea.", **kw))[-1].outputs[0].finish_reason
                except grpc.RpcError as e:
                    results[name] = e.code()

            short = threading.Thread(target=consume, args=("short",), kwargs=dict(max_tokens=12, ignore_eos=True))
            long = threading.Thread(target=consume, args=("long",), kwargs=dict(max_tokens=1000, ignore_eos=True))
            long.start()
            short.start()
            assert wait_until(lambda: c.model_info().num_running == 2, timeout=30)
            t0 = time.monotonic()
            server.signal()
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as refused:
                c.complete("Hi", max_tokens=2)
            short.join(60)
            long.join(60)
            rc = server.wait(60)
            elapsed = time.monotonic() - t0
    finally:
        server.kill()
    assert rc == 0
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert results["short"] == "length"                  # finished within the grace period
    assert results["long"] in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, "abort")
    assert elapsed < 30


def test_second_signal_cuts_the_grace_short(smollm2_engine):
    """A second SIGTERM during a long grace aborts the request in flight at once (its stream
    still ends with its final response) and the server exits 0, as a second Ctrl-C stops
    vLLM's server; it used to wait out the whole grace (leftover, session 41)."""
    server = ServerProcess(smollm2_engine, *ENGINE_ARGS, "--shutdown-grace", "600", metrics=False)
    results = {}
    try:
        with LLMClient(server.grpc, timeout=120) as c:
            def consume():
                try:
                    results["long"] = list(c.generate("Tell me about the sea.", max_tokens=1000,
                                                      ignore_eos=True))[-1].outputs[0].finish_reason
                except grpc.RpcError as e:
                    results["long"] = e.code()

            long = threading.Thread(target=consume)
            long.start()
            assert wait_until(lambda: c.model_info().num_running == 1, timeout=30)
            server.signal()
            time.sleep(1.0)
            assert server.proc.poll() is None              # the first signal waits for the request
            t0 = time.monotonic()
            server.signal()
            rc = server.wait(60)
            elapsed = time.monotonic() - t0
            long.join(60)
    finally:
        server.kill()
    assert rc == 0
    assert results["long"] == "abort"
    assert elapsed < 20


@pytest.fixture(scope="module")
def local_llm(smollm2_engine):
    """An AsyncLLM in this process, for EngineService's own tests (no server)."""
    from trtllm_lite.async_llm import AsyncLLM

    llm = AsyncLLM(smollm2_engine, num_threads=2, num_kv_blocks=256)
    yield llm
    llm.shutdown()


def local_service(llm):
    """(an EngineService over ``llm`` with metrics of its own, those metrics)."""
    from trtllm_lite.serving.engine_service import EngineService
    from trtllm_lite.serving.metrics import Metrics

    metrics = Metrics()
    return EngineService(llm, "smollm2", metrics, None), metrics


def registry_outcomes(metrics) -> dict[str, float]:
    """``trtllm_lite_request_outcomes_total`` by outcome, read from ``metrics``' registry."""
    return {s.labels["outcome"]: s.value for m in metrics.registry.collect() for s in m.samples
            if s.name == "trtllm_lite_request_outcomes_total"}


def test_a_request_closed_after_its_last_output_is_counted_once(local_llm):
    """EngineService.generate closed (aclose) once it has yielded the finished output, before
    its end: the request counts once, by its finish reason (it also counted as cancelled, so a
    front end that stops reading at the finished output, as HTTP's stream merger may, counted
    every such request twice; helper's QA note)."""
    async def run(service):
        gen = service.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "once")
        while not (await gen.__anext__()).finished:
            pass
        await gen.aclose()

    service, metrics = local_service(local_llm)
    asyncio.run(run(service))
    assert registry_outcomes(metrics) == {"length": 1.0}


def test_a_cancel_within_grpcs_deadline_rounding_counts_as_deadline_exceeded(local_llm):
    """gRPC sends a call's deadline as grpc-timeout rounded up (10 ms steps from 1 s, 100 ms
    from 10 s), so the server's deadline can lie up to 1% past the client's, and the client
    cancels the call at its own: 6-7 ms before the server's for 1-3 s deadlines, where a 5 ms
    slack counted about half of them as cancelled (QA). A cancellation within 1% (+ 5 ms) of
    the deadline counts as deadline_exceeded; one well before it still counts as cancelled."""
    async def cancel_at(service, limit, after):
        async def consume():
            params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
            async for _ in service.generate([1, 2, 3], params, None, limit):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(after)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    service, metrics = local_service(local_llm)
    asyncio.run(cancel_at(service, 3.0, 3.0 - 0.02))     # 20 ms before: within 1% + 5 ms
    assert registry_outcomes(metrics) == {"deadline_exceeded": 1.0}
    asyncio.run(cancel_at(service, 3.0, 0.5))            # a client's own cancel
    assert registry_outcomes(metrics) == {"deadline_exceeded": 1.0, "cancelled": 1.0}


@contextlib.asynccontextmanager
async def loop_gaps():
    """The running event loop's pauses (seconds) while the block runs: a task that sleeps 1 ms
    at a time records how long each sleep really took (a list, filled in as it goes)."""
    gaps, done = [], asyncio.Event()

    async def tick():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        yield gaps
    finally:
        done.set()
        await ticker


def test_the_servers_time_limit_counts_from_arrival_and_covers_the_wait_to_tokenize(local_llm):
    """``--request-timeout`` counts from the request's arrival (its admission), and a request
    still waiting for a tokenizing thread at its deadline ends then, counted as
    deadline_exceeded: a chat queued 6 s behind long text was served past a 2 s limit, and a
    prompt's bad words were refused only once tokenized (QA 16)."""
    from trtllm_lite.async_llm import SHORT_TEXT_SIZE, RequestTimeoutError
    from trtllm_lite.serving.engine_service import EngineService
    from trtllm_lite.serving.metrics import Metrics

    metrics = Metrics()
    service = EngineService(local_llm, "smollm2", metrics, request_timeout=1.0)

    async def run():
        # every tokenizing thread busy for 3 s
        busy = [asyncio.ensure_future(local_llm.tokenizing(time.sleep, 3, size=size))
                for size in [1] + [SHORT_TEXT_SIZE + 1] * (os.cpu_count() or 1)]
        await asyncio.sleep(0.1)
        start = time.monotonic()
        with local_llm.admit() as chat, local_llm.admit() as words:
            with pytest.raises(RequestTimeoutError):   # a front end's own tokenizing (a chat's template)
                await service.prepare(len, "Hi", size=1, admission=chat)
            chat_took = time.monotonic() - start
            with pytest.raises(RequestTimeoutError):   # the bad words generate tokenizes: what is left of 1 s
                await service.generate_all("Hi", SamplingParams(max_tokens=2, bad_words=["x"]), admission=words)
            words_took = time.monotonic() - start
        await asyncio.gather(*busy)
        return chat_took, words_took

    chat_took, words_took = asyncio.run(run())
    assert 0.9 < chat_took < 1.5 and words_took < 1.6, (chat_took, words_took)   # not after the 3 s wait
    assert registry_outcomes(metrics) == {"deadline_exceeded": 1.0}   # generate's (a front end counts prepare's)


def test_a_long_text_prompt_is_tokenized_while_the_event_loop_runs(local_llm):
    """AsyncLLM.generate tokenizes a text prompt on a worker thread, where the tokenizer
    releases the GIL, so the event loop every request shares keeps running: 200k CJK
    characters (within the character limit, ~0.7 s of tokenizing here, then refused as too
    many tokens) held every other stream that long on the loop (QA: 2-6 s at the limit).
    The loop's longest pause must stay well under the time tokenizing took."""
    import random

    rng = random.Random(0)
    text = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(200_000))

    async def run():
        async with loop_gaps() as gaps:
            await asyncio.sleep(0.05)
            start = time.perf_counter()
            with pytest.raises(ValueError, match="more than max_seq_len"):
                async for _ in local_llm.generate(text, SamplingParams(max_tokens=4)):
                    pass
            took = time.perf_counter() - start
        return max(gaps), took

    longest, took = asyncio.run(run())
    assert longest < took / 2, (longest, took)


def slow_bad_words(n=1000, seed=1):
    """``n`` bad words of 320 CJK characters: ~1-2 s of tokenizing, within check_words_length's
    limits (this engine: 1024 words, 331k characters)."""
    import random

    rng = random.Random(seed)
    return ["".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(320)) for _ in range(n)]


def test_a_drain_waits_for_requests_being_tokenized_or_admitted(smollm2_engine):
    """Requests that came before the engine stopped accepting (SIGTERM) are served, as those
    already in the engine are: one still being tokenized on its worker thread, and one a front
    end took (``AsyncLLM.admit``) and still prepares (renders a chat template, reads KServe
    tensors). The drain waits for both. They were refused (503 / UNAVAILABLE, or HTTP 500 once
    uvicorn's own grace ran out) and the drain returned at once (QA 15, QA 15b N2). A request
    that starts after the drain began is refused. Once the drain gives up (aborts every
    request), what an admitted request still waits for (a tokenizing thread) is refused at
    once, and the drain ends without waiting for it: it waited until the text was tokenized,
    only to refuse it then, and a server exited 3 s past a 3 s grace (QA 16)."""
    from trtllm_lite.async_llm import SHORT_TEXT_SIZE, AsyncLLM, ShuttingDownError

    words = slow_bad_words()
    llm = AsyncLLM(smollm2_engine, num_threads=2, num_kv_blocks=64)
    try:
        async def run():
            async def one():
                outs = [o async for o in llm.generate("Hello", SamplingParams(max_tokens=2, bad_words=words))]
                return outs[-1].finished

            task = asyncio.create_task(one())
            with llm.admit() as served, llm.admit() as late:
                await asyncio.sleep(0.2)                 # on its worker thread now
                assert llm.num_in_flight() == 1
                drain = asyncio.create_task(llm.drain(60))
                await asyncio.sleep(0.05)
                with pytest.raises(ShuttingDownError):
                    async for _ in llm.generate("Hello", SamplingParams(max_tokens=2)):
                        pass
                outs = [o async for o in llm.generate("Hi", SamplingParams(max_tokens=2), admission=served)]
                assert outs[-1].finished and await task
                # every tokenizing thread busy for 3 s: what `late` asks for waits for one
                busy = [asyncio.ensure_future(llm.tokenizing(time.sleep, 3, size=size))
                        for size in [1] + [SHORT_TEXT_SIZE + 1] * (os.cpu_count() or 1)]
                queued = [asyncio.ensure_future(llm.tokenizing(len, "Hi", size=1, admission=late)),
                          asyncio.ensure_future(anext(llm.generate("Hi", SamplingParams(max_tokens=2),
                                                                   admission=late)))]
                await asyncio.sleep(0.2)
                assert not drain.done()                  # `late` is still held
                start = time.monotonic()
                llm.abort_all()                          # as Server.stop does once the grace is over
                drained = await drain
                refused = await asyncio.gather(*queued, return_exceptions=True)
                took = time.monotonic() - start
                assert all(isinstance(r, ShuttingDownError) for r in refused), refused
                assert took < 1.5, took                  # not once the threads are free (3 s)
                with pytest.raises(ShuttingDownError):
                    async for _ in llm.generate("Hi", SamplingParams(max_tokens=2), admission=late):
                        pass
            await asyncio.gather(*busy)
            return drained

        assert asyncio.run(run())
        assert llm.num_in_flight() == 0
    finally:
        llm.shutdown()


def test_sigterm_serves_a_chat_still_queued_for_tokenizing(smollm2_engine):
    """A gRPC chat whose template waits for the tokenizing threads (busy with two requests'
    long bad words) when SIGTERM comes is served, like the two, and the server exits 0 (QA 15b
    N2: it was refused UNAVAILABLE). Meanwhile a short chat does not wait behind the long text:
    it has a thread of its own (QA 15b D1': it waited for them, ~12 s in a flood)."""
    words = slow_bad_words()
    long_chat = [{"role": "user", "content": "Say hello. " + "-" * 10_000}]   # past the short-text thread
    server = ServerProcess(smollm2_engine, *ENGINE_ARGS, "--shutdown-grace", "60", metrics=False)
    finished = []   # (name, finish reason or status code), in the order they ended
    try:
        with LLMClient(server.grpc, timeout=120) as c:
            def consume(name, **kw):
                try:
                    finished.append((name, c.complete(max_tokens=2, **kw).outputs[0].finish_reason))
                except grpc.RpcError as e:
                    finished.append((name, e.code()))

            threads = [threading.Thread(target=consume, args=(f"bad_words{i}",),
                                        kwargs=dict(prompt="Hello", bad_words=words)) for i in range(2)]
            threads.append(threading.Thread(target=consume, args=("long_chat",), kwargs=dict(messages=long_chat)))
            threads.append(threading.Thread(target=consume, args=("short_chat",),
                                            kwargs=dict(messages=[{"role": "user", "content": "Say hello."}])))
            for t in threads:
                t.start()
                time.sleep(0.1)
            server.signal()   # the bad words are being tokenized, the long chat waits for a thread
            for t in threads:
                t.join(120)
            rc = server.wait(120)
    finally:
        server.kill()
    assert rc == 0
    assert finished[0] == ("short_chat", "length"), finished
    assert sorted(finished) == [("bad_words0", "length"), ("bad_words1", "length"), ("long_chat", "length"),
                                ("short_chat", "length")]


def test_tokenizing_size_counts_what_makes_tokenizing_slow():
    """Work goes to the short-text thread by its size: characters, non-ASCII ones counting 4,
    plus 64 a string. Each of these took 15-500 ms on that thread as mere characters (QA 16):
    8,192 emoji, 2,048 four-character bad words, 25,000 empty chat messages."""
    from trtllm_lite.async_llm import SHORT_TEXT_SIZE, tokenizing_size

    assert tokenizing_size(["Hello " * 300]) <= SHORT_TEXT_SIZE                # 1,800 ASCII characters
    assert tokenizing_size(["\U0001F600" * 2048]) > SHORT_TEXT_SIZE
    assert tokenizing_size(["abcd"] * 2048) > SHORT_TEXT_SIZE
    assert SHORT_TEXT_SIZE < tokenizing_size([""] * 25_000) < 2 * SHORT_TEXT_SIZE   # stops counting


def test_the_tokenizing_pool_never_holds_the_process_at_exit():
    """A call still running on the tokenizing threads when the process exits is not waited for
    (concurrent.futures' threads are joined at exit: a server stopping while long prompts were
    tokenized ran past its shutdown grace; QA 15b). Results and errors reach the caller; a call
    not started is cancelled by shutdown."""
    from trtllm_lite.async_llm import DaemonPool

    pool = DaemonPool(1, "t")
    assert pool.submit(lambda: 6 * 7).result(timeout=10) == 42
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=10)
    release = threading.Event()
    running = pool.submit(release.wait)
    assert wait_until(running.running, timeout=10)
    waiting = pool.submit(lambda: 1)
    pool.shutdown()
    assert waiting.cancelled()
    release.set()
    assert running.result(timeout=10) is True
    with pytest.raises(RuntimeError, match="shut down"):   # it would wait forever
        pool.submit(lambda: 1)
    code = ("import threading; from trtllm_lite.async_llm import DaemonPool; "
            "DaemonPool(1, 't').submit(threading.Event().wait); print('exiting')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "exiting", done.stderr


def test_a_request_cancelled_after_its_first_token_counts_in_ttft(local_llm):
    """TTFT is observed at a request's first token, as vLLM does: a request cancelled after it
    is in the histogram once, with the engine's own TTFT for it (it was observed only at a
    finish, so such a request was missing), and its outcome is still counted as cancelled."""
    async def cancel_after_first_token(service):
        params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
        gen = service.generate([1, 2, 3], params, "ttft-then-cancel")
        out = await gen.__anext__()
        while not any(o.token_ids for o in out.outputs):
            out = await gen.__anext__()
        await gen.aclose()
        return out.metrics.ttft

    service, metrics = local_service(local_llm)
    engine_ttft = asyncio.run(cancel_after_first_token(service))
    ttft = {s.name: s.value for m in metrics.registry.collect() for s in m.samples
            if s.name.startswith("trtllm_lite_time_to_first_token_seconds")}
    assert ttft["trtllm_lite_time_to_first_token_seconds_count"] == 1
    assert engine_ttft > 0 and ttft["trtllm_lite_time_to_first_token_seconds_sum"] == pytest.approx(engine_ttft)
    assert registry_outcomes(metrics) == {"cancelled": 1.0}


def test_a_slow_consumer_does_not_outlive_its_deadline(local_llm):
    """A consumer slower than the engine always finds a delta waiting, and the deadline was
    checked only on an empty queue: a 1 s request ran its 64 tokens for 16 s (QA)."""
    from trtllm_lite.async_llm import RequestTimeoutError

    async def run():
        got = 0
        start = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            async for out in local_llm.generate([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True),
                                                timeout=0.5):
                got += len(out.outputs[0].token_ids)
                await asyncio.sleep(0.2)
        return got, time.monotonic() - start

    got, took = asyncio.run(run())
    assert got < 200 and took < 1.5, (got, took)
    assert wait_until(lambda: local_llm.stats()["blocks_used"] == 0)


def test_an_abort_while_the_prompt_is_tokenized_ends_the_request(local_llm):
    """``abort(id)`` of a request still on a tokenizing thread returned False and the request
    then ran to its end (QA)."""
    text = "The quick brown fox jumps over the lazy dog. " * 60   # tokenized on a worker thread

    async def run():
        outs = []

        async def consume():
            async for out in local_llm.generate(text, SamplingParams(max_tokens=20, ignore_eos=True),
                                                request_id="tok-abort"):
                outs.append(out)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)            # generate() runs up to its tokenizing thread
        assert local_llm.num_in_flight() == 1 and not local_llm.has_request("tok-abort")
        found = await local_llm.abort("tok-abort")
        again = await local_llm.abort("tok-abort")
        await task
        return found, again, outs

    found, again, outs = asyncio.run(run())
    assert (found, again) == (True, False)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 0

    async def refused_then_reused():
        # aborted while tokenized, then refused (too long): the abort must not stay behind for
        # the next request of that id
        text = "".join(chr(0x4E00 + i % 20000) for i in range(3000))   # within the character limit
        gen = local_llm.generate(text, SamplingParams(max_tokens=2), request_id="tok-abort-2")
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert await local_llm.abort("tok-abort-2")          # on its tokenizing thread
        with pytest.raises(ValueError, match="more than max_seq_len"):
            await task
        return [o async for o in local_llm.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True),
                                                    request_id="tok-abort-2")]

    later = asyncio.run(refused_then_reused())
    assert later[-1].outputs[0].finish_reason == "length"
