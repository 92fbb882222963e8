"""A request's sequence: its tokens, how many are computed, and its block table."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from ..sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is: waiting (queued, or preempted and to be recomputed), running
    (holds KV blocks and is scheduled each step) or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One generated sequence.

    vLLM v1's single rule drives it: each step, ``num_computed_tokens`` (tokens whose K/V
    are in the cache) catches up with ``len(token_ids)``; prefill, chunked prefill and
    decode are the same loop. ``block_table[i]`` is the physical block holding positions
    ``[i * block_size, (i + 1) * block_size)``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)   # full blocks' prefix-cache keys
    num_registered_blocks: int = 0   # leading blocks already findable in the prefix cache
    num_cached_tokens: int = 0       # prompt tokens served from the prefix cache
    generator: np.random.Generator | None = None
    detokenizer: object | None = None
    text: str = ""                   # output text so far (cut at a stop string)
    num_text_sent: int = 0           # characters of ``text`` already streamed
    logprobs: list | None = None     # per output token {token_id: Logprob}, when asked
    index: int = 0                   # which of the request's n sequences
    request: "Request | None" = None  # the request this sequence belongs to
    spec_token_ids: list[int] = field(default_factory=list)   # draft tokens to verify this step
    spec_acceptance: float = 1.0     # recent acceptance rate of its proposals (EMA)
    spec_backoff: int = 0            # steps between probes while backed off (0: not backed off)
    spec_next_probe: int = 0         # engine step of the next probe while backed off

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            seed = self.params.seed if self.index == 0 else [self.params.seed, self.index]
            self.generator = np.random.default_rng(seed)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    """A user request: one prompt, ``params.n`` sequences (forked after the prompt's
    prefill, sharing its KV blocks), and the prompt's logprobs when asked."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list | None = None
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and (
            len(self.seqs) == self.params.n or any(s.finish_reason == "abort" for s in self.seqs))

    @property
    def num_cached_tokens(self) -> int:
        return self.seqs[0].num_cached_tokens if self.seqs else 0
