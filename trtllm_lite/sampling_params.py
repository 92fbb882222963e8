"""Per-request sampling and stopping parameters, with vLLM / TensorRT-LLM names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    Args:
        max_tokens: most output tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability sum reaches it (0, 1].
        seed: a per-request random generator: the same seed gives the same tokens whatever
            else is in the batch.
        stop_token_ids: token ids that end the request (besides EOS unless ``ignore_eos``).
        ignore_eos: keep generating after EOS.
        skip_special_tokens: leave special tokens out of the text.

    Raises:
        ValueError: a value is out of range; the message names the parameter.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not self.temperature >= 0:
            bad("temperature", "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1: all tokens)")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", "must be a non-negative integer")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
