"""``AsyncLLM``: the asyncio streaming API; the engine steps on its own thread.

Requests are validated in the caller's thread, then handed to the engine thread through a
command queue; each request's deltas come back through its own bounded stream (see
:class:`RequestStream`). The step loop never runs on the event loop, so a long step does
not stall a server's I/O. Servers also get admission control (``max_waiting_requests``),
per-request deadlines, a stats snapshot that never blocks, and a drain for graceful shutdown.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from typing import AsyncIterator

from .core.llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an internal error; requests cannot be served."""


class EngineStepError(RuntimeError):
    """A step failed on an internal error; the requests in flight were aborted (the engine
    goes on serving new ones)."""


class ShuttingDownError(RuntimeError):
    """The engine no longer accepts requests (shutdown or drain in progress)."""


class QueueFullError(OverflowError):
    """Too many requests wait to be scheduled (``max_waiting_requests``)."""


class DuplicateRequestIdError(ValueError):
    """A request's ``request_id`` is already in use (gRPC ALREADY_EXISTS, HTTP 409)."""


class RequestTimeoutError(TimeoutError):
    """The request's deadline passed; it was aborted and its KV blocks freed."""


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One delta equal to delta ``a`` followed by delta ``b`` of the same request: text,
    token ids and logprobs appended per sequence index; finish state, metrics from ``b``."""
    outs = {o.index: o for o in a.outputs}
    for o in b.outputs:
        prev = outs.get(o.index)
        if prev is None:
            outs[o.index] = o
            continue
        logprobs = prev.logprobs if o.logprobs is None else (prev.logprobs or []) + o.logprobs
        outs[o.index] = dataclasses.replace(o, text=prev.text + o.text, token_ids=prev.token_ids + o.token_ids,
                                            logprobs=logprobs)
    return dataclasses.replace(b, outputs=[outs[i] for i in sorted(outs)])


class Admission:
    """A request the engine took while it accepted, whose front end still prepares it before
    :meth:`AsyncLLM.generate` (renders and tokenizes a chat template, reads KServe tensors).
    From :meth:`AsyncLLM.admit`; a context manager: until it exits, a drain waits for it, and
    ``generate(..., admission=...)`` takes the request even after the engine stopped
    accepting, as it takes one already in flight (it is refused only if the engine stopped or
    the drain ended by aborting every request meanwhile). A SIGTERM while a chat's template
    was tokenized refused it with 503 / UNAVAILABLE (QA 15b N2)."""

    def __init__(self, llm: "AsyncLLM"):
        self._llm = llm
        self.aborts = llm._abort_all_count   # abort_all() calls before it came
        self.arrival = time.monotonic()      # when it came (s, monotonic): a server's time limit counts from it
        self._held = False

    def __enter__(self) -> "Admission":
        self._held = True
        self._llm._admissions += 1
        return self

    def __exit__(self, *exc) -> None:
        if self._held:
            self._held = False
            self._llm._admissions -= 1


class RequestStream:
    """Deltas of one request, from the engine thread to its consumer on an event loop.

    Bounded: at most ``maxsize`` items wait; when full, a new delta is merged into the last
    one (:func:`merge_deltas`), so a slow consumer never blocks the engine and never holds
    more than ``maxsize`` objects. Methods other than :meth:`put_threadsafe` run on the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int):
        self.loop = loop
        self.maxsize = maxsize
        self.items: deque = deque()
        self.event = asyncio.Event()

    def put_threadsafe(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.put, item)
        except RuntimeError:  # the consumer's loop is closed
            pass

    def put(self, item) -> None:
        if (len(self.items) >= self.maxsize and isinstance(item, RequestOutput)
                and isinstance(self.items[-1], RequestOutput)):
            self.items[-1] = merge_deltas(self.items[-1], item)
        else:
            self.items.append(item)
        self.event.set()

    async def get(self, deadline: float | None = None):
        """Next item; raises :class:`RequestTimeoutError` at ``deadline`` (monotonic s).

        The deadline is a timer that wakes the wait, not ``asyncio.wait_for``, which in Python
        3.10-3.11 can swallow a cancellation that comes as an item arrives: the consumer's
        cancel was lost and the request ran on to its deadline (a suite flake)."""
        if deadline is not None and self.items and time.monotonic() >= deadline and not self._holds_end():
            # a consumer slower than the engine always finds an item waiting: the deadline is
            # checked here too, or the request ran on to its end (QA)
            raise RequestTimeoutError("request deadline exceeded")
        while not self.items:
            self.event.clear()
            if deadline is None:
                await self.event.wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError("request deadline exceeded")
            timer = self.loop.call_later(remaining, self.event.set)
            try:
                await self.event.wait()
            finally:
                timer.cancel()
        return self.items.popleft()

    def _holds_end(self) -> bool:
        """Whether the request's last item (its finished output or its error) is queued."""
        return any(isinstance(i, BaseException) or i.finished for i in self.items)


SHORT_TEXT_SIZE = 2048   # tokenizing work up to this size (tokenizing_size) takes ~1-2 ms: a thread of its own
_PIECE_SIZE = 64         # each separately tokenized text (a bad word, a chat message's role or content)


def tokenizing_size(texts) -> int:
    """The size of tokenizing the strings ``texts`` (for :meth:`AsyncLLM.tokenizing`): their
    characters, each non-ASCII one counting 4 (CJK and emoji tokenize ~4x slower than ASCII
    text: 512 of them take ~1.1-1.3 ms), plus 64 a string (a tokenizer call, or a chat message's part: 2,048
    four-character bad words, or 25,000 empty messages, took 0.1-0.5 s; QA 16). Counting stops
    once past ``SHORT_TEXT_SIZE``, so a long list costs little to size."""
    total = 0
    for text in texts:
        total += _PIECE_SIZE + (len(text) if text.isascii() else 4 * len(text))
        if total > SHORT_TEXT_SIZE:
            break
    return total


class DaemonPool:
    """A few daemon threads running submitted calls. ``concurrent.futures``' threads are joined
    when the interpreter exits, so a server stopping while a long prompt was tokenized ran up
    to seconds past its shutdown grace (QA 15b); these are not waited for."""

    def __init__(self, workers: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        self._closed = False
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():   # cancelled while it waited
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def submit(self, fn) -> Future:
        """``fn()`` on a pool thread; its result or exception in the returned future.

        Raises:
            RuntimeError: the pool is shut down (no thread would ever run ``fn``).
        """
        if self._closed:
            raise RuntimeError("the tokenizing pool is shut down")
        future: Future = Future()
        self._jobs.put((future, fn))
        return future

    def shutdown(self) -> None:
        """Cancel the calls not started; the threads end after their current one."""
        self._closed = True
        pending = []
        while True:
            try:
                pending.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for job in pending:
            if job is not None:
                job[0].cancel()
        for _ in range(self._workers):
            self._jobs.put(None)


class AsyncLLM:
    """Stream generations from an engine shared by many concurrent callers.

    ``AsyncLLM(engine_dir, **options)`` (options as ``LLMEngine``), or
    ``AsyncLLM.from_engine(engine)``.

    Args:
        max_waiting_requests: requests accepted but not yet scheduled, at most; beyond it
            :meth:`generate` raises :class:`QueueFullError` (None: unbounded).
        stream_queue_size: deltas held per request before merging (>= 1).
    """

    def __init__(self, engine_dir: str | None = None, *, engine: LLMEngine | None = None,
                 max_waiting_requests: int | None = None, stream_queue_size: int = 64, **options):
        if max_waiting_requests is not None and max_waiting_requests < 1:   # 0 refused every request (QA)
            raise ValueError(f"max_waiting_requests must be >= 1 (None: unbounded), got {max_waiting_requests}")
        if stream_queue_size < 1:
            raise ValueError(f"stream_queue_size must be >= 1, got {stream_queue_size}")
        self.engine = engine or LLMEngine(engine_dir, **options)
        self.max_waiting_requests = max_waiting_requests
        self.stream_queue_size = stream_queue_size
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestStream, object]] = {}
        self._aborting: set[str] = set()   # ids whose consumer left and whose abort is queued
        self._abort_requested: set[str] = set()   # ids abort() was called for, until their stream ends
        self._preparing = 0        # requests being tokenized on a worker thread (not in _streams yet)
        # their ids -> one mark per generate() call, True once aborted by that id: an abort may
        # name a request still being tokenized (a mark per call, not per id: a later request
        # reusing the id must not take another's abort; QA)
        self._preparing_calls: dict[str, list[list[bool]]] = {}
        self._abort_all_count = 0  # abort_all() calls: a request tokenized across one is refused
        self._admissions = 0       # admit()'s requests whose front end still holds them (a drain waits)
        self._aborts_at_stop = 0   # abort_all() calls before the engine stopped accepting
        self._error: BaseException | None = None
        self._accepting = True
        self._stopped = False
        self.num_step_errors = 0
        self._stats = self._snapshot()
        # tokenizing threads of their own (the tokenizer releases the GIL): long prompts queue
        # here, not in asyncio's default executor, where responses are encoded; short text has
        # a thread of its own, so it never waits behind long text
        self._tokenizer_pool = DaemonPool(os.cpu_count() or 1, "trtllm-lite-tokenize")
        self._short_text_pool = DaemonPool(1, "trtllm-lite-tokenize-short")
        self._thread = threading.Thread(target=self._loop, name="trtllm-lite-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine(cls, engine: LLMEngine, **options) -> "AsyncLLM":
        """An AsyncLLM over an :class:`LLMEngine` already made (its engine thread takes the
        engine over: do not step it elsewhere); ``options`` as the constructor's."""
        return cls(engine=engine, **options)

    async def tokenizing(self, fn, *args, size: int, admission: Admission | None = None,
                         deadline: float | None = None):
        """``fn(*args)`` on the tokenizing threads, off the event loop: for work that tokenizes
        text (prompts, chat templates, bad words), which releases the GIL while it runs.
        ``size``: the work's :func:`tokenizing_size` (or a request's size in bytes). Up to
        ``SHORT_TEXT_SIZE`` (~1-2 ms of tokenizing: 2,048 ASCII characters took 1.4 ms, 8,192
        took 8 ms, 8,192 CJK 25 ms; QA 16), the call runs on a thread of its own, so
        short text never waits behind long text (during a flood of 24 long prompts, a short
        chat waited ~12 s; QA 15b D1'); larger work shares one thread per core.

        ``admission``: the request's (:meth:`admit`), when the work prepares one. Once the
        request can only be refused (the drain gave up: ``abort_all`` after the engine stopped
        accepting), :class:`ShuttingDownError` comes within ~50 ms, not when its text has been
        tokenized, and a call not started is dropped. ``deadline`` (monotonic s): the request's;
        :class:`RequestTimeoutError` comes within ~50 ms of it, the same way.
        """
        return await self._tokenize(functools.partial(fn, *args), size,
                                    None if admission is None else admission.aborts, deadline)

    async def _tokenize(self, call, size: int, aborts: int | None, deadline: float | None):
        """``call()`` on a tokenizing thread; for a request that came before ``aborts``
        abort_all() calls (not None), refused once :meth:`_refuses` it, or past ``deadline``:
        with 8 requests' long bad words queued, a server exited 3 s past a 3 s grace tokenizing
        text only to refuse it then, and a request queued 6 s was served past a 2 s
        --request-timeout (QA 16)."""
        pool = self._short_text_pool if size <= SHORT_TEXT_SIZE else self._tokenizer_pool
        future = asyncio.wrap_future(pool.submit(call))
        if aborts is None and deadline is None:
            return await future
        try:
            while not (await asyncio.wait({future}, timeout=0.05))[0]:
                if aborts is not None and self._refuses(aborts):
                    raise ShuttingDownError("the engine is shutting down and accepts no new requests")
                if deadline is not None and time.monotonic() >= deadline:
                    raise RequestTimeoutError("request deadline exceeded")
            return future.result()
        finally:
            future.cancel()   # a call not started yet never runs (a finished one is unaffected)

    def _refuses(self, aborts: int) -> bool:
        """Whether a request that came after ``aborts`` abort_all() calls is refused now: the
        engine stopped, or stopped accepting and aborted every request since it came."""
        return self._stopped or (not self._accepting and self._abort_all_count != aborts)

    @staticmethod
    def _tokenizing_size(prompt, params: SamplingParams | None) -> int | None:
        """The :func:`tokenizing_size` of building the request (its text prompt, its bad
        words), or None when it tokenizes no text (token ids: cheap)."""
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        words = getattr(params, "bad_words", None) if params is not None else None
        if not isinstance(prompt, str) and not words:
            return None
        return tokenizing_size(([prompt] if isinstance(prompt, str) else []) + list(words or ()))

    @property
    def tokenizer(self):
        """The engine's :class:`~trtllm_lite.tokenizer.Tokenizer` (from its engine directory)."""
        return self.engine.tokenizer

    @property
    def accepting(self) -> bool:
        """True while :meth:`generate` takes new requests."""
        return self._accepting and not self._stopped and self._error is None

    @property
    def dead(self) -> bool:
        """True once the engine thread has stopped on an error or exited (every stream then
        ends in :class:`EngineDeadError`)."""
        return self._error is not None or not self._thread.is_alive()

    # -- public API -----------------------------------------------------------------------
    def admit(self) -> Admission:
        """Take a request whose front end prepares it before :meth:`generate` (see
        :class:`Admission`; use it as ``with llm.admit() as admission:``).

        Raises:
            ShuttingDownError / EngineDeadError: as :meth:`generate`.
        """
        self._check_accepting()
        return Admission(self)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, timeout: float | None = None,
                       cache_salt: str | None = None,
                       admission: Admission | None = None) -> AsyncIterator[RequestOutput]:
        """Yield delta :class:`RequestOutput`s (new text and token ids) until ``finished``.

        Args:
            timeout: seconds from now until the request is aborted (None: no deadline).
            cache_salt: prefix-cache blocks are shared only with requests of the same salt.
            admission: the request's :meth:`admit`, when its front end prepared it: it is taken
                as one that came before the engine stopped accepting.

        Raises:
            ValueError / TypeError: bad input, before anything is queued (the message names
                the parameter; an over-long prompt names the limit).
            QueueFullError: ``max_waiting_requests`` requests already wait.
            ShuttingDownError: the engine no longer accepts requests.
            RequestTimeoutError: the deadline passed; the request was aborted.
            EngineStepError / EngineDeadError: an internal error ended the request.

        If the consumer's iteration ends early (its task cancelled, the generator closed:
        ``async with contextlib.aclosing(llm.generate(...))``, as the servers use it), the
        request is aborted and its KV blocks return within one step. A generator merely left
        unreferenced is closed only when Python finalizes it (as an ``async for`` broken out of
        without ``aclosing``; vLLM's alike): close it to free the blocks at once.
        """
        if admission is None:
            self._check_accepting()
        deadline = None if timeout is None else time.monotonic() + timeout
        # tokenizing (the prompt, bad_words) runs on a worker thread, where it releases the GIL:
        # on the event loop, a long prompt stopped every other request's stream while it ran.
        # It came before the engine stopped accepting, so a drain waits for it (a SIGTERM while
        # it was tokenized refused it with 503 / UNAVAILABLE, or HTTP 500 once uvicorn's own
        # grace ran out; QA 15); it is refused only if the engine stopped, or the drain ended in
        # an abort_all, meanwhile
        aborts = self._abort_all_count if admission is None else admission.aborts
        request_id = request_id or uuid.uuid4().hex
        size = self._tokenizing_size(prompt, sampling_params)
        aborted_early = False   # aborted while it was tokenized: it ends at once, as 'abort'
        if size is None:   # token ids: no thread hop
            request = self.engine.make_request(prompt, sampling_params, request_id, cache_salt)
        else:
            self._preparing += 1
            mark = [False]
            self._preparing_calls.setdefault(request_id, []).append(mark)
            try:
                request = await self._tokenize(functools.partial(self.engine.make_request, prompt, sampling_params,
                                                                 request_id, cache_salt), size, aborts, deadline)
            finally:
                self._preparing -= 1
                calls = self._preparing_calls[request_id]
                calls.remove(mark)
                if not calls:
                    del self._preparing_calls[request_id]
            aborted_early = mark[0]   # (no await from here to its stream: no abort can come between)
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error!r}")
        if self._refuses(aborts):
            raise ShuttingDownError("the engine is shutting down and accepts no new requests")
        rid = request.request_id
        if rid in self._streams or rid in self._aborting:
            raise DuplicateRequestIdError(f"request_id {rid!r} is already in use")
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting_requests() >= limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests wait to be scheduled)")
        stream = RequestStream(asyncio.get_running_loop(), self.stream_queue_size)
        self._streams[rid] = (stream, request)
        self._commands.put(("add", request))
        if aborted_early:
            self._abort_requested.add(rid)
            self._commands.put(("abort", rid))
        finished = False
        try:
            while True:
                item = await stream.get(deadline)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            self._abort_requested.discard(rid)
            if not finished:
                self._aborting.add(rid)     # the id stays taken until the engine has aborted it
                self._commands.put(("abort", rid))

    def _check_accepting(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error!r}")
        if not self.accepting:
            raise ShuttingDownError("the engine is shutting down and accepts no new requests")

    async def abort(self, request_id: str) -> bool:
        """Abort a request by id, in any state (its stream ends with finish reason
        'abort'). Idempotent; returns whether the request was in flight here and not already
        being aborted (a second call before the stream ends returns False)."""
        calls = self._preparing_calls.get(request_id)
        if calls and request_id not in self._streams:   # being tokenized (QA: the abort was lost)
            found = not all(mark[0] for mark in calls)
            for mark in calls:
                mark[0] = True
            return found
        found = request_id in self._streams and request_id not in self._abort_requested
        if found:
            self._abort_requested.add(request_id)
        self._commands.put(("abort", request_id))
        return found

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` has an open stream (submitted and not yet finished, aborted
        or failed)."""
        return request_id in self._streams

    def num_in_flight(self) -> int:
        """Requests accepted and not finished (being tokenized, waiting, running, or being queued)."""
        return len(self._streams) + self._preparing

    def num_waiting_requests(self) -> int:
        """Requests accepted but not scheduled yet (including those still being queued)."""
        return sum(1 for _, r in list(self._streams.values())
                   if r.seqs and r.seqs[0].first_scheduled_time is None)

    def stats(self) -> dict:
        """The engine's :meth:`~LLMEngine.stats` as of the last step or command (never
        blocks on a running step), plus ``num_in_flight`` and ``num_step_errors``."""
        s = dict(self._stats)
        s.update(num_in_flight=self.num_in_flight(), num_step_errors=self.num_step_errors)
        return s

    def abort_all(self) -> None:
        """Abort every request in the engine; each stream ends with finish reason 'abort'."""
        self._abort_all_count += 1
        self._commands.put(("abort_all", None))

    def stop_accepting(self) -> None:
        """Refuse new requests (:class:`ShuttingDownError`); in-flight ones go on."""
        if self._accepting:
            self._aborts_at_stop = self._abort_all_count
        self._accepting = False

    async def drain(self, timeout: float, cut_short: asyncio.Event | None = None) -> bool:
        """Stop accepting, then wait up to ``timeout`` s for in-flight requests (those being
        tokenized too, and admitted ones their front ends still prepare: :meth:`admit`) to
        finish, or until ``cut_short`` is set (the server's second signal). Returns True if
        none is left."""
        self.stop_accepting()
        end = time.monotonic() + timeout
        while not self._drained() and time.monotonic() < end and not (cut_short and cut_short.is_set()):
            await asyncio.sleep(0.02)
        return self._drained()

    def _drained(self) -> bool:
        # once the drain has given up (abort_all while not accepting), requests still being
        # tokenized or prepared can only be refused (_refuses): no need to wait for them
        gave_up = not self._accepting and self._abort_all_count != self._aborts_at_stop
        return not self._streams and (gave_up or (not self._preparing and not self._admissions))

    def shutdown(self) -> None:
        """Stop the engine thread (in-flight requests are aborted)."""
        self.stop_accepting()
        self._stopped = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)
        self._tokenizer_pool.shutdown()
        self._short_text_pool.shutdown()

    # -- engine thread --------------------------------------------------------------------
    def _snapshot(self) -> dict:
        return self.engine.stats()

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            entry[0].put_threadsafe(item)

    def _handle(self, command) -> bool:
        kind, arg = command
        if kind == "add":
            try:
                self.engine.add(arg)
            except (ValueError, OverflowError) as e:
                self._deliver(arg.request_id, QueueFullError(str(e)) if isinstance(e, OverflowError) else e)
        elif kind == "abort":
            out = self.engine.abort(arg)
            if out is not None:
                self._deliver(arg, out)
            self._aborting.discard(arg)
        elif kind == "abort_all":
            self._abort_all()
        elif kind == "stop":
            self._abort_all()
            return False
        return True

    def _abort_all(self, error: BaseException | None = None) -> None:
        for rid in list(self.engine.requests):
            out = self.engine.abort(rid)
            if out is not None or error is not None:
                self._deliver(rid, error if error is not None else out)

    def _loop(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                try:
                    command = self._commands.get(block=block)
                    if not self._handle(command):
                        return
                    while True:
                        if not self._handle(self._commands.get_nowait()):
                            return
                except queue.Empty:
                    pass
                self._stats = self._snapshot()
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - fail every open stream, keep the error
            self._error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine stopped: {e!r}"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
            self.num_step_errors += 1
            log.exception("an engine step failed; its %d requests are aborted and serving goes on",
                          len(self._streams))
            self._abort_all(EngineStepError(f"internal error in an engine step: {e!r}"))
            self._stats = self._snapshot()
            return
        self._stats = self._snapshot()   # before the deltas: whoever saw a delta sees this step's stats
        for out in outputs:
            self._deliver(out.request_id, out)


__all__ = ["AsyncLLM", "EngineDeadError", "EngineStepError", "QueueFullError", "RequestStream",
           "RequestTimeoutError", "ShuttingDownError", "merge_deltas"]
