"""Inflight (continuous) batching with a token budget, chunked prefill and preemption.

Every step the batch is rebuilt: running sequences first (decodes, then unfinished
prompt chunks, in arrival order), then waiting sequences are admitted while
``max_num_seqs``, the token budget (``max_num_batched_tokens``) and free KV blocks allow.
A sequence's share of the step is ``len(token_ids) - num_computed_tokens``, cut to the
budget when chunked prefill is on. When the pool runs dry, the newest running sequence
is preempted by recompute: its blocks are freed and it goes back to the front of the
waiting queue, to resume from its prompt plus the tokens it already generated.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from ..runners.base import ScheduledSeq, StepBatch
from .kv_cache_manager import KVCacheManager, blocks_for
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    """Scheduling limits (vLLM names).

    ``max_num_seqs``: sequences per step; ``max_num_batched_tokens``: tokens per step;
    ``max_seq_len``: prompt + output tokens per sequence; ``enable_chunked_prefill``: cut
    long prompts into chunks that share the token budget with decodes.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_seq_len: int = 2048
    enable_chunked_prefill: bool = True
    max_waiting: int = 1 << 20


@dataclass
class SchedulerOutput:
    """The sequences of one step and what each computes, aligned with ``batch``."""

    seqs: list[Sequence]
    batch: StepBatch
    preempted: list[Sequence]


class Scheduler:
    """Picks each step's work (vLLM v1's unified scheduler, one token budget for prompts and
    decodes). Running sequences first: decodes (one token, plus any draft tokens to verify),
    then prompts still being prefilled, each in arrival order, a prompt chunked to what is left
    of ``max_num_batched_tokens`` (chunked prefill). When a running sequence needs a block and
    the pool has none, the latest-arrived running sequence not yet scheduled this step gives
    its blocks back and waits again at the front of the queue, to be recomputed (preemption by
    recompute, vLLM's default). Then waiting sequences are admitted, each reusing its longest
    cached prefix, while the budget, ``max_num_seqs`` and the pool allow (none in a step that
    preempted).

    Args:
        config: the step limits (:class:`SchedulerConfig`).
        kv: the block tables and pool (:class:`KVCacheManager`).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- admission ------------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Refuse at admission a request that could never run, even alone in the pool.

        Raises:
            ValueError: the prompt plus ``max_tokens`` exceeds ``max_seq_len``, the pool, or
                (without chunked prefill) the token budget.
        """
        c = self.config
        self.check_room(seq.num_prompt_tokens, seq.params.max_tokens)
        total = seq.num_prompt_tokens + seq.params.max_tokens
        if not c.enable_chunked_prefill and total > c.max_num_batched_tokens:
            raise ValueError(f"prompt + max_tokens = {total} exceeds max_num_batched_tokens "
                             f"{c.max_num_batched_tokens} and chunked prefill is off")

    def check_room(self, num_prompt_tokens: int, max_tokens: int, name: str = "max_tokens") -> None:
        """Refuse ``max_tokens`` output tokens after a prompt of ``num_prompt_tokens`` when the
        two never fit one sequence: past ``max_seq_len`` or the whole KV pool (the engine's
        ``max_model_len``).

        Args:
            num_prompt_tokens: the prompt's length (tokens).
            max_tokens: output tokens at most.
            name: the request field ``max_tokens`` came from, first in the message (the HTTP
                chat route passes ``max_completion_tokens``).

        Raises:
            ValueError: prompt + ``max_tokens`` exceeds ``max_seq_len`` or the pool; a prompt
                that leaves no room for one output token is named as the cause (the message
                starts with ``prompt``), not ``max_tokens``, which a client may not have sent.
        """
        c = self.config
        total = num_prompt_tokens + max_tokens
        pool = self.kv.pool.num_blocks * self.kv.block_size
        # the smaller limit binds, and is the one named (QA: past a 768-token pool, "exceeds
        # max_seq_len 2048")
        if pool < c.max_seq_len and blocks_for(total, self.kv.block_size) > self.kv.pool.num_blocks:
            self._refuse_past_pool(num_prompt_tokens, total, pool, name)
        if total > c.max_seq_len:
            if num_prompt_tokens >= c.max_seq_len:
                raise ValueError(f"prompt ({num_prompt_tokens} tokens) leaves no room for output: "
                                 f"it reaches max_seq_len {c.max_seq_len}")
            raise ValueError(f"{name} ({max_tokens}) + prompt ({num_prompt_tokens} "
                             f"tokens) = {total} exceeds max_seq_len {c.max_seq_len}")
        if blocks_for(total, self.kv.block_size) > self.kv.pool.num_blocks:
            self._refuse_past_pool(num_prompt_tokens, total, pool, name)

    def _refuse_past_pool(self, num_prompt_tokens: int, total: int, pool: int, name: str) -> None:
        if num_prompt_tokens >= pool:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) leaves no room for output: the whole "
                             f"pool holds {pool} tokens ({self.kv.pool.num_blocks} x {self.kv.block_size} tokens)")
        raise ValueError(f"{name} + prompt = {total} tokens needs more KV blocks than the "
                         f"whole pool holds ({self.kv.pool.num_blocks} x {self.kv.block_size} tokens)")

    @property
    def num_preempted_waiting(self) -> int:
        """Preempted sequences back in ``waiting`` to resume (not new requests): they go back to
        its front (:meth:`_preempt`) and new ones to its back, so they are its head."""
        return sum(1 for _ in itertools.takewhile(lambda s: s.num_preemptions, self.waiting))

    def add(self, seq: Sequence) -> None:
        # requests not yet scheduled; preempted sequences waiting to resume are not requests
        # the limit keeps out (QA: 2 preempted children of an n = 4 request filled a limit of 2)
        if len(self.waiting) - self.num_preempted_waiting >= self.config.max_waiting:
            raise OverflowError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self.check_fits(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        c = self.config
        budget = c.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []

        # 1. running sequences: decodes first, then prompt chunks, arrival order within each
        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.arrival_time))
        i = 0
        while i < len(order):
            seq = order[i]
            n = self._num_new_tokens(seq, budget)
            if n == 0:
                i += 1
                continue
            if seq.spec_token_ids:        # draft tokens ride along with the pending token
                seq.spec_token_ids = seq.spec_token_ids[:max(0, budget - n)] if n == 1 else []
                n += len(seq.spec_token_ids)
            while not self.kv.allocate_slots(seq, n):
                # the newest not-yet-scheduled sequence gives its blocks back (maybe seq itself)
                victim = max(order[i:], key=lambda s: s.arrival_time)
                order.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]

        # 2. admit waiting sequences (never while one had to be preempted this step),
        #    reusing their longest cached prefix. A request of n > 1 runs one sequence through
        #    its prompt and forks the others after it: their places are kept from its
        #    admission, so a step never holds more than max_num_seqs (QA: 4 requests of n = 4
        #    made 16 at a cap of 4; TensorRT's decode profile ends at max_num_seqs)
        reserved = sum(_forks_to_come(s) for s in self.running)
        while self.waiting and not preempted and budget > 0 and \
                len(self.running) + reserved + 1 + _forks_to_come(self.waiting[0]) <= c.max_num_seqs:
            seq = self.waiting[0]
            computed = self.kv.get_computed_blocks(seq)
            hit_tokens = len(computed) * self.kv.block_size
            n = self._num_new_tokens(seq, budget, seq.num_computed_tokens + hit_tokens)
            if n == 0 or not self.kv.allocate_slots(seq, n, computed):
                break
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                self.kv.record_prefix_query(seq.num_prompt_tokens, hit_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            reserved += _forks_to_come(seq)
            scheduled.append((seq, n))
            budget -= n

        batch = StepBatch()
        seqs_decode, seqs_prefill = [], []
        for seq, n in scheduled:
            if seq.spec_token_ids:
                item = ScheduledSeq(seq.token_ids + seq.spec_token_ids, seq.block_table,
                                    seq.num_computed_tokens, n, num_logits=n)
            else:
                item = ScheduledSeq(seq.token_ids, seq.block_table, seq.num_computed_tokens, n)
            if n == 1 and item.samples:
                batch.decode.append(item)
                seqs_decode.append(seq)
            else:
                batch.prefill.append(item)
                seqs_prefill.append(seq)
        return SchedulerOutput(seqs_decode + seqs_prefill, batch, preempted)

    def _num_new_tokens(self, seq: Sequence, budget: int, computed: int | None = None) -> int:
        n = seq.num_tokens - (seq.num_computed_tokens if computed is None else computed)
        if n > budget:
            return budget if self.config.enable_chunked_prefill else 0
        return n

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free its blocks and put it at the front of the queue."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # -- after the step -------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (any state) and free its blocks at once. Idempotent."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()


def _forks_to_come(seq: Sequence) -> int:
    """Sequences ``seq``'s request will still fork from it (n - 1 before its prompt is done)."""
    request = seq.request
    return 0 if request is None or seq.index else request.params.n - len(request.seqs)
