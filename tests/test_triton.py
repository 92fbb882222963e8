"""trtllm-lite engines in a real Triton Inference Server (Python backend), driven by stock
``tritonclient`` over gRPC.

One ``tritonserver`` (from the ``nvidia-pytriton`` wheel, installed by
``trtllm_lite.triton.install`` apart from our venv) serves two models written by
``write_model_repository``: ``smollm2`` (the real SmolLM2 engine) and ``tiny`` (random
weights, SmolLM2's tokenizer). References: ``LLM.generate`` on the same engines in-process.
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from trtllm_lite import LLM, SamplingParams
from trtllm_lite.ensemble_tensors import INPUTS, INPUTS_BY_NAME, NUMPY_DTYPE, OUTPUTS
from trtllm_lite.triton.repository import EXTRA_OUTPUTS, config_pbtxt, parse_option, write_model_repository

from .conftest import build

grpcclient = pytest.importorskip("tritonclient.grpc")

PROMPT = "The capital of France is"
STORY = "<|im_start|>user\nWrite a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory, smollm2_engine) -> str:
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer, so it takes text prompts."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("triton-tiny")
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(root / "hf", safe_serialization=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(smollm2_engine, name)):
            shutil.copy(os.path.join(smollm2_engine, name), root / "hf" / name)
    return build(str(root / "hf"), str(root / "engine"), max_seq_len=256, max_num_batched_tokens=256,
                 max_num_seqs=16, block_size=4)


@pytest.fixture(scope="module")
def triton_install():
    """The server and this venv's stub environment (installed once; skipped if impossible)."""
    from trtllm_lite.triton.install import install

    try:
        return install()
    except (subprocess.CalledProcessError, FileNotFoundError, OSError) as e:
        pytest.skip(f"cannot install the Triton server (nvidia-pytriton) here: {e}")


@pytest.fixture(scope="module")
def server(tmp_path_factory, triton_install, smollm2_engine, tiny_engine):
    from trtllm_lite.triton.server import TritonServer

    repo = tmp_path_factory.mktemp("triton-repo")
    write_model_repository(smollm2_engine, repo, "smollm2", {"num_threads": 2, "num_kv_blocks": 256,
                                                             "cancellation_check_period_ms": 20,
                                                             "stats_check_period_ms": 20})
    write_model_repository(tiny_engine, repo, "tiny", {"num_threads": 1, "verify_checksums": False},
                           copy_engine=True)
    log = repo / "tritonserver.log"
    srv = TritonServer(repo, install=triton_install, log_file=log)
    try:
        srv.start(timeout=240)
    except RuntimeError as e:
        pytest.skip(f"the Triton server did not start: {e}")
    yield srv
    code = srv.stop()
    text = log.read_text(errors="replace")
    assert code == 0, f"tritonserver exited with {code}"
    assert "Traceback" not in text, text[-4000:]


@pytest.fixture(scope="module")
def tiny_llm(tiny_engine):
    return LLM(tiny_engine, num_threads=1, verify_checksums=False)


# -- client helpers ------------------------------------------------------------------------
def tensors(prompt: str | bytes, max_tokens: int, stream: bool, **extra) -> list:
    """Ensemble input tensors, shape [1, 1] (batch of one), dtypes from the ensemble table."""
    values = {"text_input": prompt if isinstance(prompt, bytes) else prompt.encode(),
              "max_tokens": max_tokens, "stream": stream, **extra}
    out = []
    for name, value in values.items():
        spec = INPUTS_BY_NAME.get(name)
        datatype = spec.datatype if spec else "INT32"
        array = np.array([[value]], dtype=NUMPY_DTYPE[datatype])
        t = grpcclient.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        out.append(t)
    return out


class Stream:
    """One client (own gRPC channel) with one bidirectional ModelStreamInfer stream."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, model: str, prompt, max_tokens: int, stream: bool, **extra) -> None:
        self.client.async_stream_infer(model, tensors(prompt, max_tokens, stream, **extra),
                                       enable_empty_final_response=True)

    def next(self, timeout: float = 120.0):
        """(result, error) of the next response."""
        return self.responses.get(timeout=timeout)

    def collect(self, timeout: float = 120.0) -> tuple[list, Exception | None]:
        """Results of one request until its final response, and its error if it failed."""
        results = []
        while True:
            result, error = self.next(timeout)
            if error is not None:
                return results, error
            if result.as_numpy("text_output") is not None:
                results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results, None

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def texts(results) -> list[str]:
    return [r.as_numpy("text_output").reshape(-1)[0].decode() for r in results]


def run(url: str, model: str, prompt, max_tokens: int, stream: bool, **extra):
    s = Stream(url)
    try:
        s.send(model, prompt, max_tokens, stream, **extra)
        return s.collect()
    finally:
        s.close()


def metrics(server, model: str) -> dict[str, float]:
    """The model's nv_trt_llm_* gauges from Triton's /metrics, keyed 'family/type'."""
    body = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    out = {}
    for family, labels, value in re.findall(r'^(nv_trt_llm_\w+)\{([^}]*)\} (\S+)$', body, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("model") == model:
            kind = next(v for k, v in fields.items() if k.endswith("_type"))
            out[f"{family.removeprefix('nv_trt_llm_').removesuffix('_metrics')}/{kind}"] = float(value)
    return out


def wait_for(predicate, timeout: float = 15.0, period: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    return predicate()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


# -- repository ----------------------------------------------------------------------------
def test_repository_config_parses_and_is_served(server, smollm2_engine, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = config_pbtxt("m", smollm2_engine, {"max_num_seqs": 8, "enable_prefix_caching": False})
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert config.backend == "python" and config.model_transaction_policy.decoupled
    assert [i.name for i in config.input] == [t.name for t in INPUTS]
    assert [o.name for o in config.output] == [t.name for t in OUTPUTS + EXTRA_OUTPUTS]
    assert {k: v.string_value for k, v in config.parameters.items()} == {
        "engine_dir": smollm2_engine, "max_num_seqs": "8", "enable_prefix_caching": "false"}

    served = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("tiny").config
    assert served.model_transaction_policy.decoupled
    assert served.parameters["engine_dir"].string_value == "engine"  # copied into the repository

    with pytest.raises(ValueError, match="max_num_seqs must be in"):
        write_model_repository(smollm2_engine, tmp_path, "m", {"max_num_seqs": 10_000})
    with pytest.raises(ValueError, match="model_name"):
        write_model_repository(smollm2_engine, tmp_path, "a/b")
    with pytest.raises(ValueError, match="num_threads must be an integer"):
        parse_option("num_threads", "two")
    with pytest.raises(ValueError, match="unknown parameter 'max_beam_width'"):
        parse_option("max_beam_width", "1")
    # written as given before (QA): a period of 0 made the model's watcher spin a core
    with pytest.raises(ValueError, match="cancellation_check_period_ms must be an integer >= 1, got 0"):
        parse_option("cancellation_check_period_ms", "0")
    with pytest.raises(ValueError, match="stats_check_period_ms must be an integer >= 1, got -5"):
        write_model_repository(smollm2_engine, tmp_path, "m", {"stats_check_period_ms": -5})
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        parse_option("seed", "-1")
    with pytest.raises(ValueError, match="max_waiting must be an integer >= 1"):   # the engine's least
        parse_option("max_waiting", "0")


# -- generation ----------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [PROMPT, "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"])
def test_smollm2_streamed_and_whole_text_equal_llm_generate(server, smollm2_llm, prompt):
    ref = smollm2_llm.generate(prompt, greedy(20))[0].outputs[0]
    results, error = run(server.grpc_url, "smollm2", prompt, 20, True, temperature=0.0,
                         return_num_output_tokens=True)
    assert error is None
    assert "".join(texts(results)) == ref.text
    assert results[-1].as_numpy("num_output_tokens").item() == len(ref.token_ids)
    assert len(results) == len(ref.token_ids)  # one response per generated token

    results, error = run(server.grpc_url, "smollm2", prompt, 20, False, temperature=0.0)
    assert error is None and texts(results) == [prompt + ref.text]  # TensorRT-LLM: prompt included
    results, error = run(server.grpc_url, "smollm2", prompt, 20, False, temperature=0.0,
                         exclude_input_in_output=True)
    assert error is None and texts(results) == [ref.text]


def test_tiny_engine_stream_matches_llm_generate_greedy_and_seeded(server, tiny_llm):
    cases = [(dict(temperature=0.0), greedy(24)),
             (dict(temperature=0.9, top_k=50, seed=7), SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=7)),
             (dict(temperature=0.0, stop_words=" the"), SamplingParams(max_tokens=24, temperature=0.0, stop=[" the"]))]
    for extra, params in cases:
        ref = tiny_llm.generate("Once upon a time", params)[0].outputs[0]
        results, error = run(server.grpc_url, "tiny", "Once upon a time", 24, True, **extra)
        assert error is None, extra
        assert "".join(texts(results)) == ref.text, extra


@pytest.mark.parametrize("stream", [True, False])
def test_num_return_sequences_tag_each_response_with_its_sequence_index(server, tiny_llm, stream):
    params = SamplingParams(n=2, max_tokens=16, temperature=0.9, seed=3)
    refs = [o.text for o in tiny_llm.generate("Once upon a time", params)[0].outputs]
    results, error = run(server.grpc_url, "tiny", "Once upon a time", 16, stream, num_return_sequences=2,
                         temperature=0.9, seed=3, exclude_input_in_output=True)
    assert error is None
    by_index = {0: "", 1: ""}
    for r in results:
        by_index[r.as_numpy("sequence_index").item()] += texts([r])[0]
    assert [by_index[0], by_index[1]] == refs


def test_16_concurrent_streams_batch_together_and_are_correct(server, smollm2_llm):
    prompts = [f"{PROMPT}" if i == 0 else f"Question {i}: what is {i} plus {i}? Answer:" for i in range(16)]
    refs = [o.outputs[0].text for o in smollm2_llm.generate(prompts, greedy(12))]
    steps_before = metrics(server, "smollm2")["general/iteration_counter"]
    got: list = [None] * 16
    streams = [Stream(server.grpc_url) for _ in prompts]

    def one(i):
        streams[i].send("smollm2", prompts[i], 12, True, temperature=0.0)
        got[i] = streams[i].collect()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
    finally:
        for s in streams:
            s.close()
    for i, (results, error) in enumerate(got):
        assert error is None, (i, error)
        assert "".join(texts(results)) == refs[i], i
    steps = wait_for(lambda: metrics(server, "smollm2")["general/iteration_counter"] - steps_before)
    assert steps < 16 * 12 / 2, f"{steps} engine steps for 16 x 12 tokens: requests were not batched"


@pytest.mark.parametrize("how", ["cancel", "disconnect"])
def test_cancelled_stream_frees_its_blocks_and_server_keeps_serving(server, smollm2_llm, how):
    assert wait_for(lambda: metrics(server, "smollm2")["kv_cache_block/used"] == 0)
    s = Stream(server.grpc_url)
    try:  # min_tokens: no EOS before 300 tokens, so the request is surely running when cancelled
        s.send("smollm2", STORY, 300, True, temperature=0.0, min_tokens=300)
        for _ in range(3):
            result, error = s.next()
            assert error is None
        busy = wait_for(lambda: metrics(server, "smollm2")["kv_cache_block/used"] > 0)
        assert busy, "KV blocks in use are not reported while a request runs"
    finally:
        if how == "cancel":
            s.close(cancel=True)  # gRPC cancellation of the stream: Triton cancels its requests
        else:
            s.client._channel.close()  # the client goes away without a word

    idle = wait_for(lambda: (lambda m: m["kv_cache_block/used"] == 0 and m["request/active"] == 0)(
        metrics(server, "smollm2")), timeout=10)
    assert idle, f"blocks not freed after cancellation: {metrics(server, 'smollm2')}"

    def settled():   # nothing runs on (the step that saw the cancellation may still be ending)
        steps = metrics(server, "smollm2")["general/iteration_counter"]
        time.sleep(0.3)
        return metrics(server, "smollm2")["general/iteration_counter"] == steps

    assert wait_for(settled, timeout=5), "the engine kept stepping after the cancelled request's blocks were freed"

    ref = smollm2_llm.generate(PROMPT, greedy(8))[0].outputs[0].text
    results, error = run(server.grpc_url, "smollm2", PROMPT, 8, True, temperature=0.0)
    assert error is None and "".join(texts(results)) == ref


@pytest.mark.parametrize("extra, expected", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(beam_width=2), "beam_width"),
    (dict(num_return_sequences=0), "input tensor 'num_return_sequences': n must be"),   # the tensor sent
    (dict(max_tokens=0), "max_tokens"),
    (dict(prompt=b"\xff\xfe not utf-8"), "UTF-8"),
    (dict(prompt="hello " * 300), "input tensor 'text_input': prompt has"),   # the engine's check, named
    (dict(cache_salt=b""), "cache_salt"),           # the salt reaches the engine, which refuses an empty one
])
def test_bad_parameter_fails_that_request_only(server, tiny_llm, extra, expected):
    long_run = Stream(server.grpc_url)  # a good request streams on beside the bad one
    try:
        long_run.send("tiny", "Once upon a time", 200, True, temperature=0.0)
        prompt = extra.pop("prompt", "Once upon a time")
        max_tokens = extra.pop("max_tokens", 8)
        results, error = run(server.grpc_url, "tiny", prompt, max_tokens, True, **extra)
        assert error is not None and expected in str(error), str(error)
        good, good_error = long_run.collect()
    finally:
        long_run.close()
    assert good_error is None
    assert "".join(texts(good)) == tiny_llm.generate("Once upon a time", greedy(200))[0].outputs[0].text


def test_launcher_stops_the_server_on_sigterm(tmp_path, triton_install, tiny_engine):
    """``python -m trtllm_lite.triton.server`` under a supervisor's SIGTERM: it stopped only on
    Ctrl-C, and tritonserver with its stub lived on holding the ports (QA)."""
    from trtllm_lite.triton.server import free_port

    write_model_repository(tiny_engine, tmp_path / "repo", "tiny", {"num_threads": 1, "verify_checksums": False})
    ports = [free_port() for _ in range(3)]
    launcher = subprocess.Popen([sys.executable, "-m", "trtllm_lite.triton.server", "--model-repository",
                                 str(tmp_path / "repo"), "--prefix", str(triton_install.prefix),
                                 "--grpc-port", str(ports[0]), "--http-port", str(ports[1]),
                                 "--metrics-port", str(ports[2])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def ready():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        if not wait_for(ready, timeout=240):
            pytest.skip("the Triton server did not start")
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0
        assert not ready()
        for port in ports:   # the server and its stub are gone: every port binds again (past TIME_WAIT)
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                s.listen()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_triton_repo_flags_below_their_minimum_are_named(tmp_path, tiny_engine, capsys):
    """``trtllm-lite triton-repo --cancellation-check-period-ms -5`` wrote the value (QA)."""
    from trtllm_lite.cli import main

    for flag, value in (("--cancellation-check-period-ms", "-5"), ("--num-threads", "0"), ("--seed", "-1")):
        with pytest.raises(SystemExit) as exit_info:
            main(["triton-repo", "--engine", tiny_engine, "--output", str(tmp_path / "repo"), flag, value])
        assert exit_info.value.code == 2
        assert f"argument {flag}: must be an integer >=" in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()
    (tmp_path / "file").write_text("")
    assert main(["triton-repo", "--engine", tiny_engine, "--output", str(tmp_path / "file")]) == 1
    err = capsys.readouterr().err
    assert "output (--output)" in err and "is a file, not a model repository directory" in err
