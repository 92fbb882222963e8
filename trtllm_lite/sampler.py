"""Vectorised token sampling over the whole batch (numpy).

Greedy rows take the argmax. Sampled rows: logits / temperature, top-k and top-p
filtering (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"), then
inverse-CDF sampling with one uniform draw per row. A seeded request draws from its own
generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import numpy as np

from .sampling_params import SamplingParams


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of ``[N, V]`` float32, stable."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top_k_mask(logits: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Set logits below each row's k-th largest to -inf (``k <= 0``: keep all). In place."""
    vocab = logits.shape[-1]
    for kk in np.unique(k[(k > 0) & (k < vocab)]):
        rows = np.nonzero(k == kk)[0]
        kth = -np.partition(-logits[rows], kk - 1, axis=-1)[:, kk - 1:kk]
        logits[rows] = np.where(logits[rows] < kth, -np.inf, logits[rows])
    return logits


def top_p_mask(probs: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Zero the tail outside each row's nucleus of mass ``p`` and renormalise. In place.

    The most likely token always stays, so a tiny ``p`` gives the greedy token.
    """
    for r in np.nonzero(p < 1.0)[0]:
        order = np.argsort(-probs[r], kind="stable")
        cum = np.cumsum(probs[r, order])
        keep = int(np.searchsorted(cum, p[r] * cum[-1])) + 1
        probs[r, order[keep:]] = 0.0
        probs[r] /= probs[r].sum()
    return probs


class Sampler:
    """Picks the next token of every row.

    Args:
        seed: seed of the shared generator that unseeded requests draw from.
    """

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray, params: list[SamplingParams],
                 generators: list[np.random.Generator | None]) -> np.ndarray:
        """Sample ``[N]`` int64 tokens from ``logits [N, V]`` float32, one row per request."""
        tokens = logits.argmax(axis=-1)
        rows = np.array([not p.greedy for p in params], bool)
        if not rows.any():
            return tokens
        idx = np.nonzero(rows)[0]
        temps = np.array([params[i].temperature for i in idx], np.float32)[:, None]
        x = logits[idx] / temps
        top_k_mask(x, np.array([params[i].top_k for i in idx]))
        probs = top_p_mask(softmax(x), np.array([params[i].top_p for i in idx]))
        u = np.array([(generators[i] or self.rng).random() for i in idx])
        cdf = np.cumsum(probs, axis=-1)
        choice = (cdf < u[:, None] * cdf[:, -1:]).sum(axis=-1)
        tokens[idx] = np.minimum(choice, logits.shape[-1] - 1)
        return tokens
