"""``speculative_config`` in the vLLM habit."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from ..sampling_params import is_integer


@dataclass
class SpeculativeConfig:
    """How draft tokens are proposed.

    Args:
        method: ``"ngram"`` (prompt lookup in the request's own tokens) or ``"draft_model"``
            (a smaller engine with the same tokenizer, e.g. one built with ``--draft-layers``).
        num_speculative_tokens: k, draft tokens proposed per step (>= 1).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes tried, longest first.
        draft_engine: engine directory of the draft model (method ``draft_model``).
        draft_num_kv_blocks: blocks in the draft model's own KV pool (default: the target's).
        min_acceptance_rate: below this recent acceptance rate a sequence backs off: it
            probes with one draft token after ``backoff_probe_interval`` steps, doubling the
            wait (up to 64 steps) while probes keep failing. Between 0.4 and 0.6 a sequence
            proposes 2 tokens, below 0.4 one: drafts past the first are rarely reached.
        backoff_probe_interval: steps before the first probe once backed off.

    Raises:
        ValueError: a value out of range, naming it.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_engine: str | None = None
    draft_num_kv_blocks: int | None = None
    min_acceptance_rate: float = 0.3
    backoff_probe_interval: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config method must be 'ngram' or 'draft_model', got {self.method!r}")
        if not is_integer(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens!r}")
        # (QA 25: a string failed with a TypeError naming nothing; 0 or less was kept, or
        # silently replaced by the default)
        for name in ("prompt_lookup_min", "prompt_lookup_max", "backoff_probe_interval"):
            if not is_integer(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.draft_num_kv_blocks is not None and (not is_integer(self.draft_num_kv_blocks)
                                                     or self.draft_num_kv_blocks < 1):
            raise ValueError(f"draft_num_kv_blocks must be an integer >= 1, got {self.draft_num_kv_blocks!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be >= 1 and <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.draft_engine:
            raise ValueError("speculative_config method 'draft_model' needs draft_engine")
        if isinstance(self.min_acceptance_rate, bool) or not isinstance(self.min_acceptance_rate, numbers.Real) \
                or not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(f"min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate!r}")

    @classmethod
    def from_any(cls, value) -> "SpeculativeConfig | None":
        """Accept None, a SpeculativeConfig, or a dict of its fields.

        Raises:
            ValueError: a dict key that is not a field (named), or a bad field value.
            TypeError: ``value`` of another type.
        """
        if value is None:
            return None
        if isinstance(value, cls):   # checked again: it may have changed since it was made (QA 25)
            return dataclasses.replace(value)
        if isinstance(value, dict):
            fields = [f.name for f in dataclasses.fields(cls) if f.init]
            unknown = sorted(str(k) for k in value if k not in fields)
            if unknown:
                raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known: {', '.join(fields)}")
            return cls(**value)
        raise TypeError("speculative_config must be a dict or SpeculativeConfig")
