"""What every front end (gRPC ``LLMService``, KServe v2, OpenAI HTTP) shares: one
``AsyncLLM``, prompt building (text, token ids, chat), error classes with their gRPC / HTTP
codes, per-request metrics, and the accumulation of streamed deltas into a final result.
"""
from __future__ import annotations

import asyncio
import enum
import math
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Sequence

from ..async_llm import (Admission, AsyncLLM, DuplicateRequestIdError, EngineDeadError, EngineStepError, QueueFullError,
                         RequestTimeoutError, ShuttingDownError, tokenizing_size)
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import Metrics
from .params import make_sampling_params


#: Seconds before a request's deadline from which a cancellation counts as the deadline's,
#: plus this fraction of the time it had: gRPC sends a deadline as grpc-timeout rounded up
#: (10 ms steps from 1 s, 100 ms from 10 s), so the server's deadline can lie up to 1% past
#: the client's, which cancels the call at its own (6-7 ms early for 1-3 s deadlines).
_DEADLINE_SLACK = 0.005
_DEADLINE_SLACK_RATIO = 0.01


class ErrorKind(enum.Enum):
    """A request's failure, named as gRPC status codes name it; ``http`` is the HTTP status."""

    INVALID_ARGUMENT = 400
    UNAUTHENTICATED = 401
    NOT_FOUND = 404
    ALREADY_EXISTS = 409
    RESOURCE_EXHAUSTED = 429
    INTERNAL = 500
    UNAVAILABLE = 503
    DEADLINE_EXCEEDED = 504

    @property
    def http(self) -> int:
        return self.value


def classify(error: BaseException) -> ErrorKind:
    """The :class:`ErrorKind` of an exception raised while serving a request."""
    if isinstance(error, (QueueFullError, OverflowError)):
        return ErrorKind.RESOURCE_EXHAUSTED
    if isinstance(error, (RequestTimeoutError, asyncio.TimeoutError)):
        return ErrorKind.DEADLINE_EXCEEDED
    if isinstance(error, ShuttingDownError):
        return ErrorKind.UNAVAILABLE
    if isinstance(error, (EngineDeadError, EngineStepError)):
        return ErrorKind.INTERNAL
    if isinstance(error, DuplicateRequestIdError):
        return ErrorKind.ALREADY_EXISTS
    if isinstance(error, (ValueError, TypeError)):
        return ErrorKind.INVALID_ARGUMENT
    return ErrorKind.INTERNAL


class RequestBatch:
    """The requests one client call started together (an HTTP completions request's prompts).

    When one of them fails, the call fails with that error and the server ends the others:
    :meth:`fail` says so, and those others are then not counted in the request outcomes (the
    failed one counts the call's error once, as a call refused before any prompt started
    would), rather than as ``cancelled``: the client cancelled nothing. Requests that finish
    before the call's fate is known (:meth:`commit`: every prompt started and answered) are
    held, and counted only if it succeeds: a prompt refused after the others finished (its
    text took longer to tokenize) gave a 400 counted as that error and as their ``length``.
    """

    def __init__(self):
        self.failed = False
        self.committed = False
        self._held: list[tuple] = []

    def finished(self, record, acc: "Accumulator") -> None:
        """``record(acc)`` (a finished request's count) now, or at :meth:`commit`."""
        if self.committed:
            record(acc)
        elif not self.failed:
            self._held.append((record, acc))

    def commit(self) -> None:
        """The call succeeded (every prompt started): count what was held, and later finishes."""
        self.committed = True
        held, self._held = self._held, []
        for record, acc in held:
            record(acc)

    def fail(self) -> None:
        self.failed = True
        self._held.clear()

    def end(self, error: BaseException) -> None:
        """The call ends with ``error``: a cancellation (the client left: what finished before
        counts, the rest as ``cancelled``), or a prompt's failure (:meth:`fail`)."""
        if isinstance(error, asyncio.CancelledError):
            self.commit()
        else:
            self.fail()


@dataclass
class SequenceResult:
    """One sequence's accumulated output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Accumulator:
    """Joins the deltas of one request: whole text/tokens per sequence, usage, timing."""

    def __init__(self):
        self.seqs: dict[int, SequenceResult] = {}
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.last = out
        for o in out.outputs:
            s = self.seqs.setdefault(o.index, SequenceResult(o.index))
            s.text += o.text
            s.token_ids += o.token_ids
            if o.logprobs is not None:
                s.logprobs = (s.logprobs or []) + o.logprobs
            s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.last.prompt_token_ids) if self.last else 0

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs.values())

    @property
    def num_cached_tokens(self) -> int:
        return self.last.num_cached_tokens if self.last else 0

    def results(self) -> list[SequenceResult]:
        return [self.seqs[i] for i in sorted(self.seqs)]

    def timing_ms(self) -> dict[str, float]:
        """``ttft_ms``, ``e2e_ms``, ``queue_ms``, ``tpot_ms`` from the engine's metrics."""
        m = self.last.metrics if self.last else None
        if m is None:
            return {}
        ttft, e2e = m.ttft, m.e2e
        queue = None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time
        longest = max((len(s.token_ids) for s in self.seqs.values()), default=0)
        tpot = (e2e - ttft) / (longest - 1) if ttft is not None and e2e is not None and longest > 1 else None
        return {k: v * 1e3 for k, v in (("ttft_ms", ttft), ("e2e_ms", e2e), ("queue_ms", queue),
                                        ("tpot_ms", tpot)) if v is not None}


class EngineService:
    """One engine served to many front ends.

    Args:
        llm: the running ``AsyncLLM``.
        model_name: the name clients use for the model.
        metrics: where request metrics go.
        request_timeout: seconds a request may run at most (None: no server limit); a
            client deadline that is shorter wins.
    """

    def __init__(self, llm: AsyncLLM, model_name: str, metrics: Metrics,
                 request_timeout: float | None = None):
        self.llm = llm
        self.model_name = model_name
        self.metrics = metrics
        self.request_timeout = request_timeout
        metrics.bind(llm)

    @property
    def tokenizer(self):
        if self.llm.tokenizer is None:
            raise ValueError("this engine has no tokenizer: send token ids")
        return self.llm.tokenizer

    # -- requests -------------------------------------------------------------------------
    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` for the tokenize routes: text with more characters than
        ``max_seq_len`` tokens can cover is refused before it is tokenized, as for a prompt
        (tokenizing runs on the event loop both front ends share: 13 MB took ~25 s, every
        other request stalled). Raises ``ValueError`` naming the prompt."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                     max_tokens=self.llm.engine.scheduler_config.max_seq_len)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True, name: str = "token_ids") -> str:
        """Text of token ids for the detokenize routes. At most ``max_seq_len`` ids, the longest
        sequence the engine holds, are decoded: decoding holds the GIL on the event loop all front
        ends share (3M ids stalled every stream 2.7 s), so a longer list is refused before it is
        read. Raises ``ValueError`` naming ``name`` for that and for an id outside the vocabulary."""
        limit = self.llm.engine.scheduler_config.max_seq_len
        if len(ids) > limit:
            raise ValueError(f"{name} has {len(ids)} token ids, more than max_seq_len {limit}")
        vocab = self.llm.engine.model_config["vocab_size"]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}: {bad[0]} is outside the vocabulary [0, {vocab})")
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @staticmethod
    def chat_size(messages: Sequence[Mapping[str, Any]]) -> int:
        """The ``tokenizing_size`` of rendering and tokenizing the messages (roles, contents:
        strings) for ``AsyncLLM.tokenizing``."""
        return tokenizing_size(m.get(k) or "" for m in messages for k in ("role", "content"))

    def chat_prompt(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template (as
        ``LLM.chat``). Raises ``ValueError`` for malformed messages or no template."""
        if not messages:
            raise ValueError("messages is empty")
        text = self.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False, name="messages",
                                     max_tokens=self.llm.engine.scheduler_config.max_seq_len)

    def sampling_params(self, values: Mapping[str, Any]) -> SamplingParams:
        return make_sampling_params(values)

    def timeout(self, client_timeout: float | None, admission: Admission | None = None) -> float | None:
        """Seconds a request has left (None: no limit): the client's ``client_timeout`` (s from
        now) or the server's ``request_timeout``, counted from the request's arrival when it
        has an ``admission`` (a request queued 6 s for tokenizing was served past a 2 s
        limit; QA 16), whichever ends first."""
        server = self.request_timeout
        if server is not None and admission is not None:
            server = max(server - (time.monotonic() - admission.arrival), 0.0)
        limits = [t for t in (client_timeout, server) if t is not None]
        return min(limits) if limits else None

    @staticmethod
    def _cancel_outcome(deadline: float | None, limit: float | None) -> str:
        """The outcome of a request cancelled now: ``deadline_exceeded`` once its deadline has
        passed, or within 1% + 5 ms of it (see :meth:`generate`), else ``cancelled``."""
        # the caller read its deadline (as time remaining) a moment before ``deadline`` was set
        past = deadline is not None and \
            time.monotonic() >= deadline - _DEADLINE_SLACK - _DEADLINE_SLACK_RATIO * limit
        return "deadline_exceeded" if past else "cancelled"

    async def prepare(self, fn, *args, size: int, admission: Admission, timeout: float | None = None):
        """``fn(*args)``, work that tokenizes the text (of ``size``) of a generation request the
        engine took (``admission``) before :meth:`generate` (a chat template, KServe's tensors),
        on the engine's tokenizing threads (``AsyncLLM.tokenizing``). ``timeout``: the client's
        seconds left (the server's ``request_timeout`` counts from the admission); past either,
        ``RequestTimeoutError``. A request cancelled meanwhile (the client left, or its deadline
        passed) is counted in the request outcomes here, as :meth:`generate` would count it.
        Errors propagate uncounted: the caller counts its refusals."""
        timeout = self.timeout(timeout, admission)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return await self.llm.tokenizing(fn, *args, size=size, admission=admission, deadline=deadline)
        except asyncio.CancelledError:
            self.metrics.record_failed(self._cancel_outcome(deadline, timeout))
            raise

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       timeout: float | None = None, cache_salt: str | None = None,
                       batch: RequestBatch | None = None,
                       admission: Admission | None = None) -> AsyncIterator[RequestOutput]:
        """``AsyncLLM.generate`` with metrics; same deltas, same exceptions.

        Close it (``contextlib.aclosing``) or cancel its consumer to abort the request. A
        cancellation once the deadline has passed (or within 1% + 5 ms of it: gRPC rounds the
        deadline it sends up, and the client cancels at its own) counts as ``deadline_exceeded``,
        not ``cancelled``: gRPC cancels the handler at the client's deadline just as the
        request's own timer fires, and which one comes first is chance. Each request's outcome
        is counted once: closing it after its finished output was yielded adds nothing, and
        ending it because another request of its ``batch`` failed adds nothing either. Its TTFT
        is observed at its first token, as vLLM does, so a request cancelled later counts there too.
        """
        outcome = "internal"
        last_token_time = None
        acc = Accumulator()
        limit = self.timeout(timeout, admission)
        deadline = None if limit is None else time.monotonic() + limit
        try:
            gen = self.llm.generate(prompt, params, request_id, timeout=limit, cache_salt=cache_salt,
                                    admission=admission)
            async with aclosing(gen):
                async for out in gen:
                    now = time.monotonic()
                    if any(o.token_ids for o in out.outputs):
                        if last_token_time is not None:
                            self.metrics.inter_token_latency.observe(now - last_token_time)
                        else:
                            self.metrics.record_first_token(out)
                        last_token_time = now
                    acc.add(out)
                    if out.finished:
                        outcome = None
                        if batch is None:
                            self.metrics.record_finished(acc)
                        else:
                            batch.finished(self.metrics.record_finished, acc)
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            if batch is not None and batch.failed:   # the batch's error is counted where it was raised
                outcome = None
            if outcome is not None:   # a request closed after its last output was counted then
                outcome = self._cancel_outcome(deadline, limit)
            raise
        except BaseException as e:
            if outcome is not None:
                outcome = classify(e).name.lower()
                if batch is not None:
                    # the call fails with its first error, counted once: a second prompt refused
                    # before the call saw the first's error (token ids are refused as each task
                    # first runs, in one turn of the loop) was counted too (QA 15b)
                    if batch.failed:
                        outcome = None
                    batch.fail()
            raise
        finally:
            self.metrics.record_tokens(acc)
            if outcome is not None:
                self.metrics.record_failed(outcome)

    async def generate_all(self, prompt, params: SamplingParams, request_id: str | None = None,
                           timeout: float | None = None, cache_salt: str | None = None,
                           batch: RequestBatch | None = None, admission: Admission | None = None) -> Accumulator:
        """Run a request to the end; return its accumulated result."""
        acc = Accumulator()
        async with aclosing(self.generate(prompt, params, request_id, timeout, cache_salt, batch,
                                          admission)) as gen:
            async for out in gen:
                acc.add(out)
        return acc

    # -- engine facts ---------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        """Model and engine configuration, limits in force, KV pool and scheduler state."""
        engine = self.llm.engine
        model, build, sched = engine.model_config, engine.engine.build, engine.scheduler_config
        stats = self.llm.stats()
        return {
            "model_name": self.model_name, "architecture": model.get("architecture", ""),
            "backend": build.get("backend", ""), "dtype": build.get("dtype", ""),
            **{k: model.get(k, 0) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                             "head_dim", "vocab_size")},
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            # the longest request in force: max_seq_len, or less where the KV pool holds fewer
            # tokens (as HTTP's max_model_len; QA: it said the build's 64 beside a 14-token pool)
            "max_seq_len": engine.max_model_len, "max_waiting_requests": self.llm.max_waiting_requests or 0,
            "block_size": engine.block_size, "num_kv_blocks": stats["num_blocks"],
            "kv_blocks_used": stats["blocks_used"], "kv_blocks_free": stats["blocks_free"],
            "num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
            "num_preemptions": stats["num_preemptions"], "num_steps": stats["num_steps"],
            "model": model, "build": build,
        }


def position_logprobs(token_ids: list[int], entries) -> list[tuple[int, float, list]]:
    """Per position of ``token_ids``: ``(token, its logprob, [(token, Logprob), ...] by
    rank)``, from the engine's ``{token_id: Logprob}`` dicts (``entries``; a None entry, as
    for the first prompt token, gives NaN and no alternatives)."""
    out = []
    for token, entry in zip(token_ids, entries or []):
        if entry is None:
            out.append((token, math.nan, []))
            continue
        chosen = entry.get(token)
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 1 << 30, -kv[1].logprob))
        out.append((token, chosen.logprob if chosen else math.nan, ranked))
    return out
