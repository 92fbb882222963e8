"""KServe v2 (``inference.GRPCInferenceService``) with the TensorRT-LLM ensemble's tensors,
driven by the stock ``tritonclient.grpc`` against a real server process on 127.0.0.1 with
the SmolLM2 engine; references are ``LLM.generate`` in this process. Also the numpy
conversion of :mod:`trtllm_lite.ensemble_tensors` on its own."""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from trtllm_lite import SamplingParams
from trtllm_lite import ensemble_tensors as et
from trtllm_lite.serving.params import make_sampling_params

pytestmark = pytest.mark.timeout(300)
tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

PROMPT = "The capital of France is"


# -- ensemble_tensors (no server) ----------------------------------------------------------
def test_bytes_tensor_round_trip():
    items = np.array([["héllo", ""], ["日本", "a\x00b"]], dtype=object)
    raw = et.serialize_bytes_tensor(items)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[4:10] == "héllo".encode()
    back = et.deserialize_bytes_tensor(raw, (2, 2))
    assert [[b.decode() for b in row] for row in back] == items.tolist()
    with pytest.raises(ValueError, match="truncated"):
        et.deserialize_bytes_tensor(raw[:-1])
    with pytest.raises(ValueError, match="shape"):
        et.deserialize_bytes_tensor(raw, (3,))


def obj(*items):
    a = np.empty((1, len(items)), dtype=object)
    a[0, :] = [s.encode() for s in items]
    return a


def test_parse_inputs_maps_to_sampling_params():
    req = et.parse_inputs({
        "text_input": obj(PROMPT), "max_tokens": np.array([[7]], np.int32), "stream": np.array([[True]]),
        "temperature": np.array([[0.5]], np.float32), "top_k": np.array([[4]], np.int32),
        "top_p": np.array([[0.9]], np.float32), "seed": np.array([[11]], np.uint64),
        "stop_words": obj("\n", ""), "num_return_sequences": np.array([[2]], np.int32),
        "end_id": np.array([[2]], np.int32), "return_log_probs": np.array([[True]]),
        "embedding_bias_words": obj("ab"), "embedding_bias_weights": np.array([[1.5]], np.float32),
    }, encode=lambda s: [ord(c) for c in s])
    assert req.prompt == PROMPT and req.stream and req.batched and req.return_log_probs
    p = make_sampling_params(req.sampling)
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.n, p.logprobs) == (7, 0.5, 4, 11, 2, 1)
    assert p.top_p == pytest.approx(0.9) and p.stop == ["\n"] and p.stop_token_ids == [2]
    assert p.logit_bias == {ord("a"): 1.5, ord("b"): 1.5}


@pytest.mark.parametrize("inputs, message", [
    ({"text_input": obj(PROMPT)}, "'max_tokens' is required"),
    ({"text_input": obj(PROMPT), "max_tokens": np.array([[1.5]], np.float32)}, "'max_tokens' must be an integer"),
    ({"text_input": obj(PROMPT, PROMPT).reshape(2, 1), "max_tokens": np.array([[1], [1]], np.int32)}, "batch of 2"),
    ({"text_input": obj(PROMPT), "max_tokens": np.array([[1]], np.int32), "foo": np.array([1])}, "unknown input"),
    ({"text_input": np.array([[b"\xff"]], dtype=object), "max_tokens": np.array([[1]], np.int32)}, "UTF-8"),
    ({"text_input": obj(PROMPT), "max_tokens": np.array([[1]], np.int32), "beam_width": np.array([[2]], np.int32)},
     "beam_width"),
    ({"text_input": obj(PROMPT), "max_tokens": np.array([[1]], np.int32), "stream": np.array([[1]], np.int32)},
     "'stream' must be BOOL"),
    ({"text_input": np.array([[5]], np.int32), "max_tokens": np.array([[1]], np.int32)}, "'text_input' must be BYTES"),
    ({"text_input": obj(""), "max_tokens": np.array([[1]], np.int32)}, "'text_input' is empty"),
    ({"text_input": obj(PROMPT), "max_tokens": np.array([[1]], np.int32), "cache_salt": np.array([[3]], np.int32)},
     "'cache_salt' must be BYTES"),
])
def test_parse_inputs_errors_name_the_tensor(inputs, message):
    with pytest.raises(ValueError, match=message):
        et.parse_inputs(inputs)


@pytest.mark.parametrize("datatype, raw", [("INT32", b""), ("INT32", None), ("BYTES", b""), ("BYTES", None)])
def test_a_shape_past_int64_is_refused_naming_the_tensor(datatype, raw):
    """A shape of more elements than int64 counts (2^62 x 4: numpy's product wrapped to 0, so
    empty contents passed the size check) was refused with numpy's reshape message, naming no
    tensor (QA 23): the count is exact, and the error names the tensor and its shape."""
    from tritonclient.grpc import service_pb2 as kpb

    from trtllm_lite.serving.kserve import input_arrays

    request = kpb.ModelInferRequest(model_name="ensemble")
    name = "text_input" if datatype == "BYTES" else "input_ids"
    request.inputs.add(name=name, datatype=datatype, shape=[2 ** 62, 4])
    if raw is not None:
        request.raw_input_contents.append(raw)
    with pytest.raises(ValueError, match=rf"input tensor '{name}': .*\[4611686018427387904, 4\]"):
        input_arrays(request)
    request = kpb.ModelInferRequest(model_name="ensemble")   # past numpy's 64 dimensions (QA 24)
    request.inputs.add(name=name, datatype=datatype, shape=[1] * 65)
    if raw is not None:
        request.raw_input_contents.append(b"\0\0\0\0" if datatype == "INT32" else b"\1\0\0\0x")
    with pytest.raises(ValueError, match=rf"input tensor '{name}': shape has 65 dimensions, more than 64"):
        input_arrays(request)


def test_make_outputs_shapes_and_prompt_echo():
    req = et.EnsembleRequest(prompt="Q: ", return_num_output_tokens=True, return_log_probs=True)
    out = et.make_outputs(req, "A", num_output_tokens=1, token_logprobs=[-0.5])
    assert out["text_output"].shape == (1, 1) and out["text_output"][0, 0] == b"Q: A"
    assert out["num_output_tokens"].tolist() == [[1]] and out["cum_log_probs"].tolist() == [[-0.5]]
    req.exclude_input_in_output, req.batched = True, False
    assert et.make_outputs(req, ["A", "B"])["text_output"].tolist() == [b"A", b"B"]
    for spec in et.INPUTS + et.OUTPUTS:
        assert spec.datatype in et.CONFIG_DATA_TYPE and spec.datatype in et.NUMPY_DTYPE


# -- the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(smollm2_engine):
    from trtllm_lite.serving.process import ServerProcess

    with ServerProcess(smollm2_engine, "--num-threads", "2", "--no-verify-checksums", "--num-kv-blocks", "512") as s:
        yield s
        assert s.stop() == 0


@pytest.fixture(scope="module")
def triton(server):
    client = tg.InferenceServerClient(server.grpc)
    yield client
    client.close()


def tensors(prompt=PROMPT, max_tokens=12, **extra):
    """Inputs the way TensorRT-LLM's Triton examples build them: batch dimension 1."""
    values = {"text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[max_tokens]], np.int32),
              "temperature": np.array([[0.0]], np.float32), **extra}
    out = []
    for name, value in values.items():
        t = tg.InferInput(name, value.shape, et.INPUTS_BY_NAME[name].datatype)
        t.set_data_from_numpy(value)
        out.append(t)
    return out


def flag(v):
    return np.array([[v]], dtype=bool)


class Stream:
    """Collects ``async_stream_infer`` callbacks by request id."""

    def __init__(self, client):
        self.client = client
        self.q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def collect(self, ids, num_errors=0, timeout=120):
        """({id: joined pieces}, [error messages]) once every id got its final response and
        ``num_errors`` errors came (tritonclient's stream errors carry no request id)."""
        texts = {i: [] for i in ids}
        errors, open_ids = [], set(ids)
        while open_ids or len(errors) < num_errors:
            result, error = self.q.get(timeout=timeout)
            if error is not None:
                errors.append(str(error))
                continue
            resp = result.get_response()
            out = result.as_numpy("text_output")
            if out is not None:
                texts[resp.id].extend(t.decode() for t in out.reshape(-1))
            if resp.parameters["triton_final_response"].bool_param:
                open_ids.discard(resp.id)
        return texts, errors


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    return smollm2_llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]


def test_health_and_metadata(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("ensemble") and triton.is_model_ready("smollm2")
    assert not triton.is_model_ready("no-such-model")
    meta = triton.get_model_metadata("ensemble")
    assert {"text_input", "max_tokens", "stream", "stop_words"} <= {i.name for i in meta.inputs}
    assert [o.name for o in meta.outputs][0] == "text_output"
    config = triton.get_model_config("ensemble").config
    assert config.model_transaction_policy.decoupled
    with pytest.raises(InferenceServerException) as e:
        triton.get_model_metadata("no-such-model")
    assert "NOT_FOUND" in str(e.value.status())


def test_infer_and_stream_give_the_llm_text(triton, reference):
    r = triton.infer("ensemble", tensors(exclude_input_in_output=flag(True), return_num_input_tokens=flag(True),
                                         return_num_output_tokens=flag(True)))
    assert r.as_numpy("text_output").reshape(-1)[0].decode() == reference.text
    assert r.as_numpy("num_output_tokens").reshape(-1)[0] == len(reference.token_ids)
    assert r.as_numpy("num_input_tokens").reshape(-1)[0] == 5
    echoed = triton.infer("ensemble", tensors()).as_numpy("text_output").reshape(-1)[0].decode()
    assert echoed == PROMPT + reference.text          # TensorRT-LLM's default: prompt included

    s = Stream(triton)
    try:
        triton.async_stream_infer("ensemble", tensors(stream=flag(True)), request_id="s1")
        texts, errors = s.collect(["s1"])
        pieces = texts["s1"]
    finally:
        triton.stop_stream()
    assert not errors and len(pieces) > 1
    assert "".join(pieces) == reference.text


def test_streamed_sequences_of_one_request_carry_their_sequence_index(triton, smollm2_llm):
    """num_return_sequences 2 streamed: each response is one sequence's delta, and without
    TensorRT-LLM's sequence_index the two interleaved past telling apart (QA)."""
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=5, n=2)
    ref = [o.text for o in smollm2_llm.generate(PROMPT, params)[0].outputs]
    got = {0: [], 1: []}
    done = queue.Queue()

    def callback(result, error):
        done.put((result, error))

    triton.start_stream(callback=callback)
    try:
        triton.async_stream_infer("ensemble", tensors(max_tokens=10, stream=flag(True), temperature=np.array(
            [[0.8]], np.float32), seed=np.array([[5]], np.uint64), num_return_sequences=np.array([[2]], np.int32)),
            request_id="n2")
        while True:
            result, error = done.get(timeout=120)
            assert error is None, error
            text, index = result.as_numpy("text_output"), result.as_numpy("sequence_index")
            if text is not None and text.size:
                got[int(index.reshape(-1)[0])].append(text.reshape(-1)[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        triton.stop_stream()
    assert ["".join(got[0]), "".join(got[1])] == ref


def test_many_requests_on_one_stream_and_a_bad_one(triton, smollm2_llm):
    prompts = ["Once upon a time", "def fibonacci(n):", "Water boils at"]
    refs = [smollm2_llm.generate(p, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text for p in prompts]
    s = Stream(triton)
    try:
        for i, p in enumerate(prompts):
            triton.async_stream_infer("ensemble", tensors(p, 8, stream=flag(i != 1), exclude_input_in_output=flag(True)),
                                      request_id=f"r{i}")
        triton.async_stream_infer("ensemble", tensors(temperature=np.array([[-1.0]], np.float32)), request_id="bad")
        triton.async_stream_infer("ensemble", tensors(num_return_sequences=np.array([[0]], np.int32)),
                                  request_id="bad2")
        texts, errors = s.collect(["r0", "r1", "r2"], num_errors=2)
    finally:
        triton.stop_stream()
    for i, ref in enumerate(refs):
        assert "".join(texts[f"r{i}"]) == ref
    assert len(texts["r1"]) == 1                      # stream=false: one response
    assert len(errors) == 2 and any("temperature" in e for e in errors)
    assert any("'num_return_sequences'" in e for e in errors)   # the tensor sent, not SamplingParams' n


@pytest.mark.parametrize("extra, message", [
    (dict(temperature=np.array([[-1.0]], np.float32)), "temperature"),
    (dict(stream=flag(True)), "ModelStreamInfer"),
    (dict(top_p=np.array([[1.5]], np.float32)), "top_p"),
    (dict(max_tokens=np.array([[2000]], np.int32)), "max_seq_len"),
    # a sampling field's error names the tensor the client sent, not the SamplingParams field
    (dict(num_return_sequences=np.array([[0]], np.int32)), "'num_return_sequences'"),
    (dict(end_id=np.array([[-1]], np.int32)), "'end_id'"),
    (dict(end_id=np.array([[10_000_000]], np.int32)), "'end_id'"),           # past the vocabulary, at generate
    (dict(embedding_bias_words=np.array([["Paris"]], dtype=object),
          embedding_bias_weights=np.array([[500.0]], np.float32)), "'embedding_bias_weights'"),
])
def test_infer_errors_are_invalid_argument(triton, extra, message):
    inputs = tensors(**{k: v for k, v in extra.items() if k != "max_tokens"})
    if "max_tokens" in extra:
        inputs = tensors(max_tokens=int(extra["max_tokens"][0, 0]))
    with pytest.raises(InferenceServerException) as e:
        triton.infer("ensemble", inputs)
    assert "INVALID_ARGUMENT" in str(e.value.status()) and message in e.value.message()
    assert triton.infer("ensemble", tensors(max_tokens=2)).as_numpy("text_output") is not None


def test_embedding_bias_words_beyond_what_max_seq_len_tokens_cover_are_refused_untokenized(triton, smollm2_llm,
                                                                                           reference):
    """embedding_bias_words are tokenized where the request is parsed, on the event loop every
    front end shares: more characters in all than max_seq_len tokens can cover are refused
    before tokenizing, naming the tensor, as bad_words are (QA: a huge value was tokenized
    whole, every stream and /health held meanwhile). Within the bound they still work."""
    engine = smollm2_llm.engine
    limit = engine.scheduler_config.max_seq_len * engine.tokenizer.max_chars_per_token
    words = np.array([["x" * (limit // 2), "y" * (limit // 2 + 1)]], dtype=object)   # each fits alone
    bias = dict(embedding_bias_words=words, embedding_bias_weights=np.array([[0.0, 0.0]], np.float32))
    expected = f"embedding_bias_words has {limit + 1} characters in all: more than 1024 tokens can hold"
    with pytest.raises(InferenceServerException) as e:
        triton.infer("ensemble", tensors(**bias))
    assert "INVALID_ARGUMENT" in str(e.value.status()) and expected in e.value.message()
    s = Stream(triton)
    try:
        triton.async_stream_infer("ensemble", tensors(stream=flag(True), **bias), request_id="huge-bias")
        _, errors = s.collect([], num_errors=1)
    finally:
        triton.stop_stream()
    assert expected in errors[0]
    fits = dict(embedding_bias_words=np.array([["x" * 100]], dtype=object),
                embedding_bias_weights=np.array([[0.0]], np.float32))
    r = triton.infer("ensemble", tensors(exclude_input_in_output=flag(True), **fits))
    assert r.as_numpy("text_output").reshape(-1)[0].decode() == reference.text


def test_stream_cancel_frees_blocks(server, triton):
    from trtllm_lite.serving.client import LLMClient
    from trtllm_lite.serving.process import wait_until

    s = Stream(triton)
    long = tensors(max_tokens=400, stream=flag(True), min_tokens=np.array([[400]], np.int32))   # no early EOS
    triton.async_stream_infer("ensemble", long, request_id="long")
    try:
        result, error = s.q.get(timeout=60)
        assert error is None
        with LLMClient(server.grpc, timeout=30) as c:
            assert c.model_info().kv_blocks_used > 0
    finally:
        triton.stop_stream(cancel_requests=True)
    with LLMClient(server.grpc, timeout=30) as c:
        assert wait_until(lambda: c.model_info().kv_blocks_used == 0 and c.model_info().num_running == 0)
    assert triton.infer("ensemble", tensors(max_tokens=2)).as_numpy("text_output") is not None


def test_a_stream_deadline_counts_its_requests_as_deadline_exceeded(server):
    """A ModelStreamInfer stream's deadline applies to each request on it: the engine stops
    them at the time left when each came, and they count as deadline_exceeded, as a unary
    call's do (they counted as cancelled: the stream's requests had no deadline; QA)."""
    from trtllm_lite.serving.client import LLMClient
    from trtllm_lite.serving.process import wait_until

    from .test_serving_grpc import outcomes

    before = outcomes(server)
    client = tg.InferenceServerClient(server.grpc)
    s = queue.Queue()
    client.start_stream(callback=lambda result, error: s.put((result, error)), stream_timeout=1.0)
    long = tensors(max_tokens=400, stream=flag(True), min_tokens=np.array([[400]], np.int32))   # no early EOS
    client.async_stream_infer("ensemble", long, request_id="long")
    while True:
        result, error = s.get(timeout=60)
        if error is not None:
            break
    client.stop_stream()
    client.close()
    delta = lambda name: outcomes(server).get(name, 0) - before.get(name, 0)  # noqa: E731
    assert wait_until(lambda: delta("deadline_exceeded") + delta("cancelled") >= 1, timeout=10)
    assert (delta("deadline_exceeded"), delta("cancelled")) == (1, 0)
    with LLMClient(server.grpc, timeout=30) as c:
        assert wait_until(lambda: c.model_info().kv_blocks_used == 0 and c.model_info().num_running == 0)


def test_empty_final_response_and_stop_words(triton, reference):
    stop = reference.text.split()[1]                   # a word from the middle of the greedy answer
    s = Stream(triton)
    try:
        triton.async_stream_infer("ensemble", tensors(stream=flag(True), stop_words=np.array([[stop]], dtype=object)),
                                  request_id="e1", enable_empty_final_response=True)
        responses = []
        while True:
            result, error = s.q.get(timeout=60)
            assert error is None
            responses.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        triton.stop_stream()
    assert responses[-1].as_numpy("text_output") is None          # the end, on its own
    text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in responses[:-1])
    assert text == reference.text[:reference.text.index(stop)]


def test_cache_salt_reaches_the_prefix_cache(server, triton):
    """A KServe request's ``cache_salt`` keys its prefix-cache blocks: our own gRPC API, on the
    same engine, finds them cached under that salt and not under another."""
    from trtllm_lite.serving.client import LLMClient

    prompt = "A salted prompt: KServe requests share cached blocks only within one salt. " * 3
    triton.infer("ensemble", tensors(prompt, max_tokens=1, cache_salt=np.array([["kserve-a"]], dtype=object)))
    with LLMClient(server.grpc, timeout=60) as c:
        cached = lambda salt: c.complete(prompt, max_tokens=1, cache_salt=salt).usage.cached_tokens  # noqa: E731
        assert cached("kserve-b") == 0 and cached("kserve-a") >= 16
    with pytest.raises(InferenceServerException) as e:
        triton.infer("ensemble", tensors(max_tokens=1, cache_salt=np.array([[""]], dtype=object)))
    assert "INVALID_ARGUMENT" in str(e.value.status()) and "cache_salt" in e.value.message()


@pytest.mark.parametrize("name, value, datatype", [
    ("text_input", np.array([[2_000_000_000]], np.int32), "INT32"),   # once: 2 GB of NULs, the server OOM-killed
    ("cache_salt", np.array([[3]], np.int32), "INT32"),
    ("temperature", np.array([[0.0]], np.float64), "FP64"),
])
def test_wrong_datatype_is_invalid_argument_and_the_server_lives(triton, name, value, datatype):
    inputs = [t for t in tensors() if t.name() != name]
    t = tg.InferInput(name, value.shape, datatype)
    t.set_data_from_numpy(value)
    with pytest.raises(InferenceServerException) as e:
        triton.infer("ensemble", inputs + [t])
    assert "INVALID_ARGUMENT" in str(e.value.status())
    assert f"{name!r} must be {et.INPUTS_BY_NAME[name].datatype}, got {datatype}" in e.value.message()
    assert triton.infer("ensemble", tensors(max_tokens=2)).as_numpy("text_output") is not None


def test_requests_refused_before_the_engine_count_as_invalid_argument(server, triton):
    """A KServe request refused while its tensors are read (a bad value, a wrong datatype,
    stream=true on ModelInfer, an unknown model) counts once in request_outcomes under
    invalid_argument, as the other front ends count theirs; only those refused by the engine
    itself (max_tokens past max_seq_len) were counted (QA). One refused there still counts once."""
    from trtllm_lite.serving.process import wait_until

    from .test_serving_grpc import outcomes

    before = outcomes(server)
    wrong_type = [t for t in tensors() if t.name() != "temperature"]
    wrong_type.append(tg.InferInput("temperature", [1, 1], "FP64"))
    wrong_type[-1].set_data_from_numpy(np.array([[0.0]], np.float64))
    for model, inputs in [("ensemble", tensors(top_p=np.array([[1.5]], np.float32))),
                          ("ensemble", wrong_type),
                          ("ensemble", tensors(stream=flag(True))),
                          ("no-such-model", tensors()),
                          ("ensemble", tensors(max_tokens=2000))]:        # refused by the engine
        with pytest.raises(InferenceServerException):
            triton.infer(model, inputs)
    s = Stream(triton)
    try:
        triton.async_stream_infer("ensemble", tensors(temperature=np.array([[-1.0]], np.float32)), request_id="bad")
        s.collect([], num_errors=1)
    finally:
        triton.stop_stream()
    delta = lambda name: outcomes(server).get(name, 0) - before.get(name, 0)  # noqa: E731
    assert wait_until(lambda: delta("invalid_argument") >= 6, timeout=10)
    assert {k: delta(k) for k in set(outcomes(server)) if delta(k)} == {"invalid_argument": 6}


def test_unimplemented_rpcs_answer_unimplemented_and_log_no_error(server, triton):
    """Statistics (perf_analyzer and genai-perf ask for them), the repository, shared-memory,
    trace and log RPCs answer UNIMPLEMENTED; the generated base class's NotImplementedError
    also logged an ERROR with a traceback on every call (QA)."""
    before = len(server.stderr_lines)
    for call in (lambda: triton.get_inference_statistics("ensemble"), triton.get_model_repository_index,
                 triton.get_system_shared_memory_status, triton.get_trace_settings, triton.get_log_settings):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert "UNIMPLEMENTED" in str(e.value.status())
    assert triton.is_server_live()
    time.sleep(0.5)
    logged = "".join(server.stderr_lines[before:])
    assert "Traceback" not in logged and "ERROR" not in logged, logged
