"""Per-request sampling and stopping parameters, with vLLM / TensorRT-LLM names and meanings."""
from __future__ import annotations

import numbers
import reprlib
from dataclasses import dataclass, field, fields

import numpy as np

from .tokenizer import check_unicode

MAX_LOGPROBS = 20   # top-N log-probabilities per position, at most (vLLM's default cap)


def is_integer(value) -> bool:
    """An integer (Python's or numpy's), not a bool: the options' integer check."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    Sampling (applied in this order to the logits of every step):
        logit_bias: ``{token_id: bias}`` added to the logits.
        min_tokens: EOS and ``stop_token_ids`` are forbidden until this many tokens exist.
        repetition_penalty: > 0; over prompt and output tokens, positive logits are divided
            by it and negative ones multiplied (CTRL, Keskar et al. 2019). 1 = off.
        presence_penalty, frequency_penalty: in [-2, 2]; over output tokens only, subtract
            ``presence * (count > 0) + frequency * count`` (OpenAI's definition).
        temperature: >= 0; 0 is greedy (argmax after the rules above).
        top_k: keep the k most likely tokens; 0 or -1 keeps all; 1 is greedy.
        top_p: in (0, 1]; keep the smallest most-likely set reaching this mass (Holtzman et al. 2019).
        min_p: in [0, 1]; drop tokens less likely than ``min_p`` x the top token's probability.
        seed: a per-request generator: the same seed gives the same tokens whatever else is
            in the batch and however it is scheduled.
        n: sequences per request; they share the prompt's KV blocks.
    Stopping:
        max_tokens: >= 1 output tokens at most; finish reason 'length'.
        stop: strings that end the output (found across token boundaries); the text is cut
            before the first occurrence unless ``include_stop_str_in_output``. Each must be
            non-empty, valid Unicode (a lone surrogate is refused).
        stop_token_ids: tokens that end the output (as EOS does unless ``ignore_eos``).
        bad_words: strings never generated: each is tokenized (with and without a leading
            space); its last token is forbidden whenever the output ends with the rest.
    Output:
        logprobs: top-N log-probabilities per output token, of the distribution actually
            sampled from, plus the sampled token's own.
        prompt_logprobs: top-N log-probabilities per prompt token.
        skip_special_tokens: leave special tokens out of the text.

    Raises:
        ValueError: a value is out of range; the message names the parameter.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, list, tuple)):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        self._check()

    def _check(self) -> None:
        def bad(name, why):   # the value abridged: a list of a million ids is not echoed whole
            raise ValueError(f"{name} {why}, got {reprlib.repr(getattr(self, name))}")

        def is_num(v):
            return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and v == v

        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                bad(name, "must be a bool")
            setattr(self, name, bool(getattr(self, name)))
        # numpy scalars are accepted and stored as Python numbers
        for name in ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
            if is_integer(getattr(self, name)):
                setattr(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if is_num(getattr(self, name)) and not isinstance(getattr(self, name), int):
                setattr(self, name, float(getattr(self, name)))

        if not is_integer(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if not is_integer(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not is_integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not is_num(self.temperature) or not 0 <= self.temperature < float("inf"):
            bad("temperature", "must be a finite number >= 0")
        if not is_integer(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1: all tokens)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            bad("repetition_penalty", "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if self.seed is not None and (not is_integer(self.seed) or not 0 <= self.seed < 2 ** 64):
            bad("seed", "must be an integer in [0, 2**64)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        for s in self.stop:   # a lone surrogate (JSON's "\\ud800") never matches any text
            check_unicode(s, "stop")
        if any(not isinstance(s, str) or not s.strip() for s in self.bad_words):
            bad("bad_words", "must be non-empty strings, not only spaces")
        # each id once, in order: the engine looks every generated token up in this list, and a
        # million repeats of one id cost ~10 ms a token there (and ~1.7 s of checks here; QA)
        try:
            distinct = list(dict.fromkeys(self.stop_token_ids))
        except TypeError:   # unhashable: not an integer
            bad("stop_token_ids", "must be non-negative integers")
        # every item's type counts, not only the first of equal ones' (True == 1.0 == 1: [1, True]
        # and [1, 1.0] were kept as [1] while [True, 1] and [1.0] were refused); a set of types is
        # cheap for a million ids
        kinds = set(map(type, self.stop_token_ids))
        if any(not issubclass(k, numbers.Integral) or issubclass(k, (bool, np.bool_)) for k in kinds) \
                or any(t < 0 for t in distinct):
            bad("stop_token_ids", "must be non-negative integers")
        self.stop_token_ids = [int(t) for t in distinct]
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_integer(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "must be a dict {token_id: bias}")
            # integers and real numbers as given, not what int() / float() make of them (QA:
            # {1.7: 3} biased token 1, {True: 3} token 1, {1: "5"} was taken)
            if not all(is_integer(k) and isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))
                       for k, v in self.logit_bias.items()):
                bad("logit_bias", "must map integer token ids to numbers")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            if any(k < 0 or not -100 <= v <= 100 for k, v in self.logit_bias.items()):
                bad("logit_bias", "must map token ids >= 0 to biases in [-100, 100]")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the parameter if a token id is outside the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", list(self.logit_bias or {}))):
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(f"{name} token id {t} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature (near) 0 or top_k 1."""
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @classmethod
    def field_names(cls) -> list[str]:
        """The parameter names (for front ends that map request fields by name)."""
        return [f.name for f in fields(cls)]
