"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last
n tokens in its own prompt and output, and propose the k tokens that followed it
(Saxena 2023, "Prompt Lookup Decoding"; vLLM's ngram method)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for ``token_ids``, trying n from ``n_max`` down to ``n_min``."""
    tokens = np.asarray(token_ids, np.int64)
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n:]
        windows = sliding_window_view(tokens[:length - 1], n)   # matches must end before the last token
        hits = np.nonzero((windows == pattern).all(axis=1))[0]
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Stateless: proposals come from each sequence's own tokens."""

    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, seqs, limits: list[int]) -> list[list[int]]:
        """Draft tokens per sequence, at most ``limits[i]`` for sequence i."""
        return [propose_ngram(s.token_ids, min(self.k, lim), self.n_min, self.n_max) if lim > 0 else []
                for s, lim in zip(seqs, limits)]

    def release(self, seq) -> None:
        pass
