"""Vectorised token sampling over the whole batch (numpy).

Order, as in vLLM: logit bias -> min_tokens (EOS / stop tokens forbidden) -> bad words -> penalties
(repetition over prompt + output; presence and frequency over output) -> greedy rows take
the argmax; sampled rows: temperature -> top-k -> softmax -> top-p (Holtzman et al. 2019)
-> min-p (Nguyen et al. 2024) -> inverse-CDF sampling with one uniform draw per row. A
seeded request draws from its own generator, so its draws do not depend on the batch (its
logits can, in their last bits: the GEMMs' summation order follows the batch's shape, so a draw
in a distribution's tail can rarely pick another token; the engine is not batch-invariant).
Logprobs are those of the distribution actually sampled from (after every rule above).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sampling_params import SamplingParams

TOP_P_CANDIDATES = 1024   # top-p sorts only this many most likely tokens unless they hold too little mass


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    generator: np.random.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...] = ()       # EOS (unless ignored) + stop_token_ids, for min_tokens
    bad_words_ids: tuple[tuple[int, ...], ...] = ()   # token sequences never to complete


@dataclass(slots=True)
class TokenLogprobs:
    """Top-N ``(token_ids, logprobs)`` and the chosen token's ``logprob`` and 1-based ``rank``."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    logprob: float
    rank: int


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``[N, V]`` float32, stable; -inf entries get probability 0."""
    with np.errstate(over="ignore"):   # far below the peak: -inf, probability 0
        e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``[N, V]`` float32, stable (log-sum-exp shifted by the row's
    peak); -inf entries stay -inf."""
    m = x.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):   # far below the peak: -inf
        return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def modifies_logits(row: SamplingRow) -> bool:
    """Whether :meth:`Sampler.process_logits` changes ``row``'s logits (bias, min_tokens, bad
    words, penalties)."""
    return bool(row.params.logit_bias or row.bad_words_ids or row.params.has_penalties
                or (row.stop_ids and len(row.output_token_ids) < row.params.min_tokens))


def apply_logit_bias(x: np.ndarray, rows: list[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` (token id -> bias, OpenAI's definition) to its row of
    ``x [N, V]`` float32. In place."""
    for r, row in enumerate(rows):
        if row.params.logit_bias:
            ids = np.fromiter(row.params.logit_bias.keys(), np.int64)
            x[r, ids] += np.fromiter(row.params.logit_bias.values(), np.float32)


def apply_min_tokens(x: np.ndarray, rows: list[SamplingRow]) -> None:
    """Forbid (-inf) the stop token ids of rows whose output is shorter than ``min_tokens``,
    in ``x [N, V]`` float32. In place."""
    for r, row in enumerate(rows):
        if row.stop_ids and len(row.output_token_ids) < row.params.min_tokens:
            x[r, list(row.stop_ids)] = -np.inf


def apply_bad_words(x: np.ndarray, rows: list[SamplingRow]) -> None:
    """Forbid the last token of each bad word whose other tokens end the output. In place."""
    for r, row in enumerate(rows):
        out = row.output_token_ids
        for word in row.bad_words_ids:
            prefix = list(word[:-1])
            if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix):
                x[r, word[-1]] = -np.inf


def apply_penalties(x: np.ndarray, rows: list[SamplingRow]) -> None:
    """Repetition (prompt + output; CTRL, Keskar et al. 2019), presence and frequency
    (output only; OpenAI's definition) penalties, for the rows that ask for them. In place."""
    idx = [r for r, row in enumerate(rows) if row.params.has_penalties]
    if not idx:
        return
    vocab = x.shape[-1]
    outs = [np.asarray(rows[r].output_token_ids, np.int64) for r in idx]
    prompts = [np.asarray(rows[r].prompt_token_ids, np.int64) for r in idx]
    counts = np.zeros((len(idx), vocab), np.float32)
    np.add.at(counts, (np.repeat(np.arange(len(idx)), [len(o) for o in outs]),
                       np.concatenate(outs) if outs else np.zeros(0, np.int64)), 1)
    in_prompt = np.zeros((len(idx), vocab), bool)
    in_prompt[np.repeat(np.arange(len(idx)), [len(p) for p in prompts]), np.concatenate(prompts)] = True
    # any finite penalty > 0 is valid: held in float32's normal range, and a penalized logit
    # that overflows is the largest float32 (a positive one) or -inf (a negative one: banned)
    f32 = np.finfo(np.float32)
    rep = np.clip(np.array([rows[r].params.repetition_penalty for r in idx], np.float64), f32.tiny, f32.max)
    rep = rep.astype(np.float32)[:, None]
    pres = np.array([rows[r].params.presence_penalty for r in idx], np.float32)[:, None]
    freq = np.array([rows[r].params.frequency_penalty for r in idx], np.float32)[:, None]
    sub = x[idx]
    seen = in_prompt | (counts > 0)
    with np.errstate(over="ignore"):
        sub = np.where(seen, np.where(sub > 0, np.minimum(sub / rep, f32.max), sub * rep), sub)
    sub -= freq * counts + pres * (counts > 0)
    x[idx] = sub


def apply_top_k(x: np.ndarray, k: np.ndarray) -> None:
    """Set logits below each row's k-th largest to -inf (``k <= 0`` keeps all). In place."""
    vocab = x.shape[-1]
    for kk in np.unique(k[(k > 0) & (k < vocab)]):
        rows = np.nonzero(k == kk)[0]
        kth = -np.partition(-x[rows], kk - 1, axis=-1)[:, kk - 1:kk]
        x[rows] = np.where(x[rows] < kth, -np.inf, x[rows])


def _nucleus(sub: np.ndarray, p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the probability of the last token kept and its index in descending order,
    looking at the ``k`` most likely tokens only."""
    vocab = sub.shape[-1]
    cand = np.partition(-sub, k - 1, axis=-1)[:, :k] if k < vocab else -sub
    sorted_p = -np.sort(cand, axis=-1)
    cum = np.cumsum(sorted_p, axis=-1)
    keep = np.minimum((cum < p[:, None]).sum(-1), k - 1)
    return sorted_p[np.arange(len(sub)), keep], keep


def apply_top_p(probs: np.ndarray, p: np.ndarray) -> None:
    """Zero the tail outside each row's nucleus of mass ``p``; renormalise. In place.

    ``probs`` rows sum to 1. Sorts only the ``TOP_P_CANDIDATES`` most likely tokens (rows
    whose candidates hold less than ``p`` are sorted whole). The most likely token always
    stays; when it alone reaches ``p`` the row becomes one-hot on the argmax, so a tiny
    ``p`` is greedy.
    """
    rows = np.nonzero(p < 1.0)[0]
    if not len(rows):
        return
    sub, pr = probs[rows], p[rows]
    k = min(sub.shape[-1], TOP_P_CANDIDATES)
    threshold, keep = _nucleus(sub, pr, k)
    short = keep == k - 1
    if short.any() and k < sub.shape[-1]:
        threshold[short], keep[short] = _nucleus(sub[short], pr[short], sub.shape[-1])
    sub = np.where(sub < threshold[:, None], 0.0, sub)
    single = np.nonzero(keep == 0)[0]
    if len(single):
        top = probs[rows[single]].argmax(-1)
        sub[single] = 0.0
        sub[single, top] = 1.0
    probs[rows] = sub / sub.sum(-1, keepdims=True)


def apply_min_p(probs: np.ndarray, min_p: np.ndarray) -> None:
    """Min-p filtering (Nguyen et al. 2024, "Turning Up the Heat"): in ``probs [N, V]``
    float32, zero the tokens below ``min_p [N]`` times the row's largest probability and
    renormalize; rows with ``min_p`` 0 are untouched. In place."""
    rows = np.nonzero(min_p > 0)[0]
    if len(rows):
        sub = probs[rows]
        sub = np.where(sub < min_p[rows, None] * sub.max(-1, keepdims=True), 0.0, sub)
        probs[rows] = sub / sub.sum(-1, keepdims=True)


def top_logprobs(logprobs: np.ndarray, token: int, n: int) -> TokenLogprobs:
    """Top-``n`` of one row ``[V]`` (descending) plus ``token``'s logprob and rank."""
    top = np.argpartition(-logprobs, n - 1)[:n] if 0 < n < len(logprobs) else np.arange(n)
    top = top[np.argsort(-logprobs[top], kind="stable")]
    lp = float(logprobs[token])
    return TokenLogprobs(top, logprobs[top], lp, int((logprobs > lp).sum()) + 1)


class Sampler:
    """Picks the next token of every row.

    Args:
        seed: seed of the shared generator that unseeded requests draw from.
    """

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def process_logits(self, logits: np.ndarray, rows: list[SamplingRow]) -> np.ndarray:
        """Bias, min_tokens and penalties on a float32 copy of ``logits [N, V]``; ``logits``
        itself (float32), not copied, when no row asks for any of them (a copy of 64 rows of
        SmolLM2's vocabulary, 12.6 MB, took 4-9 ms, ~4% of a 64-request run's wall time)."""
        if logits.dtype == np.float32 and not any(modifies_logits(row) for row in rows):
            return logits
        x = np.array(logits, np.float32, copy=True)
        apply_logit_bias(x, rows)
        apply_min_tokens(x, rows)
        apply_bad_words(x, rows)
        apply_penalties(x, rows)
        return x

    def __call__(self, logits: np.ndarray, rows: list[SamplingRow]
                 ) -> tuple[np.ndarray, list[TokenLogprobs | None]]:
        """Sample one token per row of ``logits [N, V]`` float32.

        Returns ``(tokens [N] int64, logprobs)``; ``logprobs[i]`` is None unless row i asked.
        """
        x = self.process_logits(logits, rows)
        tokens = x.argmax(axis=-1)
        want_logprobs = [row.params.logprobs is not None for row in rows]
        dist = [None] * len(rows)                  # log-distribution per row, when asked
        sampled = np.array([not row.params.greedy for row in rows], bool)
        if sampled.any():
            idx = np.nonzero(sampled)[0]
            params = [rows[i].params for i in idx]
            # temperatures past 1e6 are uniform sampling already; capped so float32 stays finite
            temps = np.minimum([p.temperature for p in params], 1e6).astype(np.float32)
            # shifted by the row's peak first (softmax does not change): then x / T <= 0, and a
            # quotient past float32 (a penalized logit over a small T) is -inf, probability 0
            t = x[idx]
            peak = t.max(axis=-1, keepdims=True)
            with np.errstate(over="ignore", invalid="ignore"):
                t = (t - np.where(np.isfinite(peak), peak, 0)) / temps[:, None]
            apply_top_k(t, np.array([p.top_k for p in params]))
            probs = softmax(t)
            apply_top_p(probs, np.array([p.top_p for p in params]))
            apply_min_p(probs, np.array([p.min_p for p in params]))
            u = np.array([(rows[i].generator or self.rng).random() for i in idx])
            cdf = np.cumsum(probs, axis=-1)
            choice = np.minimum((cdf < u[:, None] * cdf[:, -1:]).sum(axis=-1), x.shape[-1] - 1)
            ok = np.isfinite(cdf[:, -1]) & (cdf[:, -1] > 0)      # all-masked rows stay greedy
            tokens[idx[ok]] = choice[ok]
            for j, i in enumerate(idx):
                if want_logprobs[i]:
                    with np.errstate(divide="ignore"):
                        dist[i] = np.log(probs[j])
        out: list[TokenLogprobs | None] = []
        for i, row in enumerate(rows):
            if not want_logprobs[i]:
                out.append(None)
                continue
            lp = dist[i] if dist[i] is not None else log_softmax(x[i:i + 1])[0]
            out.append(top_logprobs(lp, int(tokens[i]), row.params.logprobs))
        return tokens, out
