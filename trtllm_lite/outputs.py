"""What generation returns, in the vLLM shape."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log-probability (natural log), its 1-based rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence: ``text``, ``token_ids``, ``finish_reason`` ('stop' | 'length'
    | 'abort' | None while running), ``stop_reason`` (the stop string or stop token id that
    ended it; None for EOS or length) and, when asked, ``logprobs``: per token a dict
    ``{token_id: Logprob}`` holding the top-N and the chosen token."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timing, ``time.monotonic()`` seconds: arrival, first scheduled, first
    token, finish; ``ttft`` and ``e2e`` derived (seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's result. From ``LLM.generate`` it is cumulative (the whole text); from
    ``AsyncLLM.generate`` each item carries the delta since the previous one."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    extra: dict = field(default_factory=dict)
