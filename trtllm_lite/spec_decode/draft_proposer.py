"""Draft-model proposer: a smaller engine with the same tokenizer proposes k tokens greedily.

The draft keeps its own paged KV (its own pool and block tables). Before proposing for a
sequence it catches up on the tokens its cache lacks (the longest common prefix of what it
cached and the sequence's tokens decides; rejected draft tokens are rolled back by
trimming its block table), then runs k - 1 batched decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.kv_cache_manager import KVCacheManager, blocks_for
from ..engine_dir import load_engine_dir
from ..runners.base import ScheduledSeq, StepBatch


@dataclass(eq=False)
class DraftState:
    """What the draft's KV cache holds for one target sequence."""

    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token id lists."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if len(diff) else n


class DraftModelProposer:
    """Greedy proposals from a draft engine (its argmax: the proposal distribution is a point
    mass, which is what makes the target's verification rule exact).

    Args:
        engine_dir: the draft engine directory (same vocabulary as the target).
        k: draft tokens per step.
        num_kv_blocks: the draft pool's size in blocks.
        vocab_size: the target's vocabulary size (must match).
        num_threads: backend threads.
        prefault_kv_cache: commit the draft pool's memory at start (see
            :class:`~trtllm_lite.runners.onnxruntime_runner.OnnxRuntimeRunner`).

    Raises:
        ValueError: the draft's vocabulary differs from the target's.
    """

    def __init__(self, engine_dir: str, k: int, num_kv_blocks: int, vocab_size: int,
                 num_threads: int | None = None, prefault_kv_cache: bool = False):
        from ..runners.onnxruntime_runner import OnnxRuntimeRunner

        self.engine = load_engine_dir(engine_dir)
        if self.engine.model["vocab_size"] != vocab_size:
            raise ValueError(f"draft engine vocab_size {self.engine.model['vocab_size']} differs from "
                             f"the target's {vocab_size}")
        self.k = k
        self.block_size = self.engine.build["block_size"]
        # the draft's graphs hold positions [0, max_seq_len): a sequence past them gets no more
        # proposals (a shorter draft failed the request at its rotary tables; QA 25)
        self.max_seq_len = self.engine.build["max_seq_len"]
        self.runner = OnnxRuntimeRunner(self.engine, num_kv_blocks, num_threads,
                                        prefault_kv_cache=prefault_kv_cache)
        self.kv = KVCacheManager(num_kv_blocks, self.block_size, enable_prefix_caching=False)
        self.states: dict[object, DraftState] = {}

    def release(self, seq) -> None:
        """Free the draft blocks of a sequence that finished or was preempted."""
        state = self.states.pop(seq, None)
        if state is not None:
            self.kv.free(state)

    def _rollback(self, state: DraftState, keep: int) -> None:
        state.num_computed_tokens = keep
        need = blocks_for(keep, self.block_size)
        if len(state.block_table) > need:
            self.kv.pool.free(state.block_table[need:])
            del state.block_table[need:]

    def propose(self, seqs, limits: list[int]) -> list[list[int]]:
        """Up to ``limits[i]`` (<= k) greedy draft tokens for each sequence; none for the
        draft's positions past its ``max_seq_len``."""
        drafts: list[list[int]] = [[] for _ in seqs]
        limits, active = list(limits), []
        for i, (seq, lim) in enumerate(zip(seqs, limits)):
            # draft j (from 0) is computed at position len(token_ids) - 1 + j
            lim = limits[i] = min(lim, self.max_seq_len + 1 - len(seq.token_ids))
            if lim <= 0:
                self.release(seq)   # (its draft blocks: it will not propose again)
                continue
            state = self.states.setdefault(seq, DraftState())
            keep = min(common_prefix(state.token_ids[:state.num_computed_tokens], seq.token_ids),
                       len(seq.token_ids) - 1)
            self._rollback(state, keep)
            state.token_ids = list(seq.token_ids)
            if not self.kv.allocate_slots(state, len(state.token_ids) - keep):
                self.release(seq)            # draft pool full: no proposal this step
                continue
            active.append(i)
        for round_ in range(self.k):
            live = [i for i in active if len(drafts[i]) == round_ and limits[i] > round_]
            if not live:
                break
            pairs = []
            for i in live:
                state = self.states[seqs[i]]
                if round_:
                    state.token_ids.append(drafts[i][-1])
                    if not self.kv.allocate_slots(state, 1):
                        state.token_ids.pop()
                        continue
                pairs.append((i, ScheduledSeq(state.token_ids, state.block_table, state.num_computed_tokens,
                                              len(state.token_ids) - state.num_computed_tokens)))
            if not pairs:
                break
            batch = StepBatch(decode=[it for _, it in pairs if it.num_new_tokens == 1],
                              prefill=[it for _, it in pairs if it.num_new_tokens != 1])
            tokens = self.runner.execute(batch).argmax(-1).tolist()
            token_of = {id(it): t for it, t in zip(batch.decode + batch.prefill, tokens)}
            for i, item in pairs:
                state = self.states[seqs[i]]
                state.num_computed_tokens = len(state.token_ids)
                drafts[i].append(int(token_of[id(item)]))
        return drafts
