"""``TritonPythonModel``: a trtllm-lite engine inside Triton's Python backend (decoupled).

Threads in the backend stub process::

    stub main thread   execute(requests): read tensors, validate, hand each request to the
                       loop thread, return at once (Triton may call execute again at once)
    loop thread        asyncio: one task per request iterates AsyncLLM.generate and sends
                       each delta with the request's response sender; a watcher task polls
                       response_sender.is_cancelled() and refreshes the metrics
    engine thread      AsyncLLM's step loop: inflight batching of every client's requests

A request's life: ``execute`` parses the TensorRT-LLM ensemble tensors
(:mod:`trtllm_lite.ensemble_tensors`) into a prompt and ``SamplingParams``; a bad value is
answered at once with an ``INVALID_ARG`` error response flagged final, and nothing else is
affected. Streaming (``stream`` true) sends one response per step's delta; otherwise one
response with the whole text. The last response of a request carries
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. With ``num_return_sequences`` > 1 each sequence's
responses carry its ``sequence_index``. A request the client cancels is aborted in the
engine (its KV blocks return at once) within ``cancellation_check_period_ms`` and answered
with a ``CANCELLED`` error flagged final.

Metrics (Triton's ``/metrics``, the TensorRT-LLM backend's families and labels so existing
dashboards work), refreshed every ``stats_check_period_ms``:
``nv_trt_llm_request_metrics{request_type=active|max|scheduled|waiting}``,
``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per|fraction}``,
``nv_trt_llm_general_metrics{general_type=iteration_counter}``.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import threading
import time
import uuid

import numpy as np

from ..async_llm import AsyncLLM, EngineDeadError
from ..core.llm_engine import LLMEngine
from ..ensemble_tensors import EnsembleRequest, make_outputs, name_tensor_in_error, parse_inputs, sequence_index_tensor
from ..serving.params import make_sampling_params
from .repository import ENGINE_OPTIONS, parse_option

try:  # present only inside the Python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - imported outside Triton (docs, tools)
    pb_utils = None


def model_options(parameters: dict[str, str], version_dir: str) -> tuple[str, dict, dict]:
    """Split ``config.pbtxt`` parameters into (engine dir, ``LLMEngine`` options, model options).

    A relative ``engine_dir`` is resolved against ``version_dir``. Keys in upper case belong
    to Triton or the Python backend (e.g. ``EXECUTION_ENV_PATH``) and are ignored.

    Raises:
        ValueError: ``engine_dir`` missing, an unknown key, a value of the wrong type, or an
            engine option this runtime's ``LLMEngine`` does not take.
    """
    engine_dir = parameters.get("engine_dir")
    if not engine_dir:
        raise ValueError("config.pbtxt parameter engine_dir is missing")
    engine_dir = os.path.join(version_dir, engine_dir)  # no-op for an absolute path
    accepted = inspect.signature(LLMEngine.__init__).parameters
    engine_names = {o.name for o in ENGINE_OPTIONS}
    engine, model = {}, {}
    for key, value in parameters.items():
        if key == "engine_dir" or key.isupper():
            continue
        typed = parse_option(key, value)
        if key in engine_names:
            if key not in accepted:
                raise ValueError(f"parameter {key} is not supported by this trtllm-lite runtime")
            engine[key] = typed
        else:
            model[key] = typed
    return engine_dir, engine, model


def _parameters(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}


class _Metrics:
    """Gauges in the TensorRT-LLM backend's metric families, labelled with model and version."""

    FAMILIES = {
        "request": ("nv_trt_llm_request_metrics", "request_type", "TRT LLM request metrics",
                    ("active", "max", "scheduled", "waiting")),
        "kv": ("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "TRT LLM KV cache block metrics",
               ("max", "free", "used", "tokens_per", "fraction")),
        "general": ("nv_trt_llm_general_metrics", "general_type", "General TRT LLM metrics",
                    ("iteration_counter",)),
    }

    def __init__(self, model: str, version: str):
        self.gauges = {}
        self._families = []  # keep the families alive as long as their metrics
        for group, (name, label, description, kinds) in self.FAMILIES.items():
            family = pb_utils.MetricFamily(name=name, description=description,
                                           kind=pb_utils.MetricFamily.GAUGE)
            self._families.append(family)
            for kind in kinds:
                self.gauges[group, kind] = family.Metric(labels={"model": model, "version": version,
                                                                 label: kind})
        self._last: dict = {}

    def update(self, llm: AsyncLLM) -> None:
        engine = llm.engine
        try:  # AsyncLLM.stats() is a snapshot the engine thread takes; else read across threads
            s = llm.stats() if hasattr(llm, "stats") else engine.stats()
        except (RuntimeError, ValueError):  # a read that raced a step: skip this refresh
            return
        values = {
            ("request", "active"): s["num_running"] + s["num_waiting"],
            ("request", "max"): engine.scheduler_config.max_num_seqs,
            ("request", "scheduled"): s["num_running"],
            ("request", "waiting"): s["num_waiting"],
            ("kv", "max"): s["num_blocks"], ("kv", "free"): s["blocks_free"],
            ("kv", "used"): s["blocks_used"], ("kv", "tokens_per"): engine.block_size,
            ("kv", "fraction"): s["blocks_used"] / s["num_blocks"],
            ("general", "iteration_counter"): s["num_steps"],
        }
        for key, value in values.items():
            if self._last.get(key) != value:
                self.gauges[key].set(float(value))
                self._last[key] = value


class _ResponseState:
    """One request's output state: token counts per sequence and, when not streaming, the
    whole text and log-probs, until the request finishes."""

    def __init__(self, request: EnsembleRequest, n: int):
        self.request, self.n = request, n
        self.counts: dict[int, int] = {}
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[float]] = {}

    def add(self, out) -> list[dict[str, np.ndarray]]:
        """Output tensors of the responses delta ``out`` calls for: one per changed sequence
        when streaming; one per sequence when the request finishes otherwise."""
        stream, found = self.request.stream, []
        for c in out.outputs:
            self.counts[c.index] = self.counts.get(c.index, 0) + len(c.token_ids)
            if stream:
                found.append(self.tensors(out, c.index, c.text, _token_logprobs(c)))
            else:
                self.texts.setdefault(c.index, []).append(c.text)
                self.logprobs.setdefault(c.index, []).extend(_token_logprobs(c))
        if out.finished and not stream:
            found = [self.tensors(out, i, "".join(self.texts.get(i, [])), self.logprobs.get(i, []))
                     for i in range(self.n)]
        return found

    def tensors(self, out, index: int, text: str, logprobs: list[float]) -> dict[str, np.ndarray]:
        m, request = out.metrics, self.request
        times = {"arrival_time_ns": _ns(m.arrival_time), "first_scheduled_time_ns": _ns(m.first_scheduled_time),
                 "first_token_time_ns": _ns(m.first_token_time), "last_token_time_ns": _ns(time.monotonic())}
        tensors = make_outputs(request, text, num_input_tokens=len(out.prompt_token_ids),
                               num_output_tokens=self.counts.get(index, 0),
                               token_logprobs=logprobs if request.return_log_probs else None, times_ns=times)
        if self.n > 1:
            tensors["sequence_index"] = sequence_index_tensor(request, index)
        return tensors


class TritonPythonModel:
    """The Python-backend model (see the module docstring for its threads and protocol)."""

    def initialize(self, args: dict) -> None:
        """Load the engine named by ``config.pbtxt`` and start the loop thread.

        Raises:
            pb_utils.TritonModelException: the model is not decoupled, a parameter is bad, or
                the engine fails to load (the message says which); Triton marks the model
                unavailable.
        """
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "trtllm-lite models stream: set model_transaction_policy { decoupled: true }")
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        try:
            engine_dir, engine_options, options = model_options(_parameters(config), version_dir)
            self.llm = AsyncLLM(engine_dir, **engine_options)
        except (ValueError, OSError) as e:  # EngineError is a ValueError
            raise pb_utils.TritonModelException(f"{args['model_name']}: {e}") from None
        self.cancellation_period = options.get("cancellation_check_period_ms", 100) / 1000
        self.stats_period = options.get("stats_check_period_ms", 100) / 1000
        self.tasks: dict[str, tuple[object, asyncio.Task]] = {}  # request id -> (sender, task)
        self._watch_task: asyncio.Task | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trtllm-lite-triton", daemon=True)
        self.thread.start()
        try:
            self.metrics = _Metrics(args["model_name"], args["model_version"])
        except Exception as e:  # noqa: BLE001 - metrics off (e.g. --allow-metrics=false) must not block serving
            self.metrics = None
            pb_utils.Logger.log_warn(f"trtllm-lite: metrics disabled: {e}")
        asyncio.run_coroutine_threadsafe(self._watch(), self.loop)

    # -- requests ------------------------------------------------------------------------
    def execute(self, requests: list) -> None:
        """Queue each request on the loop thread and return at once (decoupled: None)."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed, params = self._parse(request)
            except (ValueError, TypeError) as e:   # naming the tensor sent (as the KServe front end)
                _send_error(sender, name_tensor_in_error(str(e)), pb_utils.TritonError.INVALID_ARG)
                continue
            except Exception as e:  # noqa: BLE001 - fail this request, not the batch
                _send_error(sender, f"internal error: {e!r}", pb_utils.TritonError.INTERNAL)
                continue
            request_id = f"triton-{request.request_id() or ''}-{uuid.uuid4().hex[:12]}"
            asyncio.run_coroutine_threadsafe(self._generate(request_id, sender, parsed, params), self.loop)
        return None

    def _parse(self, request) -> tuple[EnsembleRequest, object]:
        """Tensors -> (ensemble request, SamplingParams). Raises ``ValueError`` naming the tensor."""
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        tokenizer = self.llm.tokenizer
        encode = (lambda text: tokenizer.encode(text, add_special_tokens=False)) if tokenizer else None
        parsed = parse_inputs(inputs, encode, check_words=self.llm.engine.check_words_length)
        return parsed, make_sampling_params(parsed.sampling)

    async def _generate(self, request_id: str, sender, request: EnsembleRequest, params) -> None:
        """Serve one request: send its responses as the engine makes them; errors end it alone."""
        self.tasks[request_id] = (sender, asyncio.current_task())
        state = _ResponseState(request, getattr(params, "n", 1))
        try:  # aclosing: if a send fails, the request is aborted now, not when collected
            async with contextlib.aclosing(self.llm.generate(request.prompt, params, request_id,
                                                             cache_salt=request.cache_salt)) as outs:
                async for out in outs:
                    _send(sender, [_response(t) for t in state.add(out)], final=out.finished)
        except asyncio.CancelledError:  # the client cancelled: the generator's exit aborted the request
            _send_error(sender, "request cancelled", pb_utils.TritonError.CANCELLED)
        except (ValueError, TypeError) as e:
            _send_error(sender, name_tensor_in_error(str(e)), pb_utils.TritonError.INVALID_ARG)
        except OverflowError as e:
            _send_error(sender, f"server busy: {e}", pb_utils.TritonError.UNAVAILABLE)
        except EngineDeadError as e:
            _send_error(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
        except Exception as e:  # noqa: BLE001 - one request's failure (e.g. its client vanished) ends it only
            _send_error(sender, f"internal error: {e!r}", pb_utils.TritonError.INTERNAL)
        finally:
            self.tasks.pop(request_id, None)

    # -- cancellation and metrics ----------------------------------------------------------
    async def _watch(self) -> None:
        """Cancel the tasks of requests the client cancelled; refresh the metrics."""
        self._watch_task = asyncio.current_task()
        next_stats = 0.0
        while True:
            for sender, task in list(self.tasks.values()):
                try:
                    cancelled = sender.is_cancelled()
                except Exception:  # noqa: BLE001 - the sender is gone: stop the work too
                    cancelled = True
                if cancelled and not task.done():
                    task.cancel()
            now = time.monotonic()
            if self.metrics is not None and now >= next_stats:
                self.metrics.update(self.llm)
                next_stats = now + self.stats_period
            await asyncio.sleep(min(self.cancellation_period, self.stats_period))

    def finalize(self) -> None:
        """Cancel open requests (each gets a final CANCELLED response), stop the engine and the loop."""
        async def cancel_all():
            tasks = [task for _, task in self.tasks.values()] + [t for t in (self._watch_task,) if t]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=10)
        finally:
            self.llm.shutdown()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def _response(tensors: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])


def _send(sender, responses: list, final: bool) -> None:
    """Send ``responses`` in order; with ``final``, the last one (or an empty response)
    carries ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``."""
    for response in responses[:-1]:
        sender.send(response)
    if final:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if responses:
            sender.send(responses[-1], flags=flags)
        else:
            sender.send(flags=flags)
    elif responses:
        sender.send(responses[-1])


def _send_error(sender, message: str, code) -> None:
    try:
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception:  # noqa: BLE001 - the request is already closed (e.g. its stream ended)
        pass


def _token_logprobs(completion) -> list[float]:
    """The sampled tokens' log-probabilities in ``completion`` (empty if not asked for)."""
    if not completion.logprobs:
        return []
    return [d[t].logprob for t, d in zip(completion.token_ids, completion.logprobs)]


def _ns(seconds: float | None) -> int:
    return 0 if seconds is None else int(seconds * 1e9)
