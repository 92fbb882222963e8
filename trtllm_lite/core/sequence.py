"""A request's sequence: its tokens, how many are computed, and its block table."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from ..sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
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
    generator: np.random.Generator | None = None
    detokenizer: object | None = None
    text: str = ""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = np.random.default_rng(self.params.seed)

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
