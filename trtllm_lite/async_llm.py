"""``AsyncLLM``: the asyncio streaming API; the engine steps on its own thread.

Requests are validated in the caller's thread, then handed to the engine thread through a
command queue; each request's deltas come back through its own asyncio queue. The step
loop never runs on the event loop, so a long step does not stall the server's I/O.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from typing import AsyncIterator

from .core.llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an internal error; requests cannot be served."""


class AsyncLLM:
    """Stream generations from an engine shared by many concurrent callers.

    ``AsyncLLM(engine_dir, **options)`` (options as ``LLMEngine``), or
    ``AsyncLLM.from_engine(engine)``.
    """

    def __init__(self, engine_dir: str | None = None, *, engine: LLMEngine | None = None, **options):
        self.engine = engine or LLMEngine(engine_dir, **options)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="trtllm-lite-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "AsyncLLM":
        return cls(engine=engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- public API -----------------------------------------------------------------------
    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield delta :class:`RequestOutput`s (new text and token ids) until ``finished``.

        Raises ``ValueError`` / ``TypeError`` for bad input before anything is queued. If the
        consumer stops iterating (cancellation, disconnect), the request is aborted and its
        KV blocks return within one step.
        """
        if self._error is not None:
            raise EngineDeadError(f"engine stopped: {self._error!r}")
        if self._stopped:
            raise RuntimeError("AsyncLLM is shut down")
        seq = self.engine.make_sequence(prompt, sampling_params, request_id or uuid.uuid4().hex)
        if seq.request_id in self._streams:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[seq.request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", seq))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(seq.request_id, None)
            if not finished:
                self._commands.put(("abort", seq.request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request by id, in any state. Idempotent."""
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the engine thread (in-flight requests are aborted)."""
        self._stopped = True
        self._commands.put(("stop", None))
        self._thread.join(timeout=30)

    # -- engine thread --------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _handle(self, command) -> bool:
        kind, arg = command
        if kind == "add":
            try:
                self.engine.add_sequence(arg)
            except (ValueError, OverflowError) as e:
                self._deliver(arg.request_id, e)
        elif kind == "abort":
            out = self.engine.abort(arg)
            if out is not None:
                self._deliver(arg, out)
        elif kind == "stop":
            for rid in list(self.engine.requests):
                out = self.engine.abort(rid)
                if out is not None:
                    self._deliver(rid, out)
            return False
        return True

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
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - fail every open stream, keep the error
            self._error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine stopped: {e!r}"))
