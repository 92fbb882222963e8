"""What every backend's model runner takes and returns.

The scheduler hands the runner a :class:`StepBatch`: which sequences run this step and how
many new tokens each computes. The runner builds its graph inputs with
:func:`build_step_inputs`, runs the decode graph for one-token sequences and the prefill
graph for the rest, stores the new K/V in its pools, and returns the logits each sequence
asked for (``num_logits`` rows from its last new tokens: 1 to sample, all of a chunk for
prompt logprobs, k + 1 to verify k draft tokens), concatenated in batch order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens ``[start, start + num_new_tokens)``."""

    token_ids: list[int]          # the sequence's tokens so far (prompt + output)
    block_table: list[int]        # physical block per logical block
    start: int                    # num_computed_tokens before the step (= context length)
    num_new_tokens: int           # query length
    num_logits: int = -1          # logits rows from the last new tokens; -1: 1 if samples else 0

    def __post_init__(self) -> None:
        if self.num_logits < 0:
            self.num_logits = 1 if self.samples else 0

    @property
    def samples(self) -> bool:
        """True when the step computes the sequence's last token, so its logits are needed."""
        return self.start + self.num_new_tokens == len(self.token_ids)


@dataclass(slots=True)
class StepBatch:
    """The step split by graph: ``decode`` (one new token each) and ``prefill`` (the rest)."""

    decode: list[ScheduledSeq] = field(default_factory=list)
    prefill: list[ScheduledSeq] = field(default_factory=list)

    @property
    def num_logits(self) -> int:
        """Rows of logits the runner returns for this batch."""
        return sum(s.num_logits for s in self.decode + self.prefill)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.decode + self.prefill)


@dataclass(slots=True)
class StepInputs:
    """Graph inputs of one call (shapes in :mod:`builder.export_onnx`), all int64."""

    input_ids: np.ndarray        # [T]
    positions: np.ndarray        # [T]
    slot_mapping: np.ndarray     # [T]
    block_tables: np.ndarray     # [S, max_blocks]
    context_lens: np.ndarray     # [S]
    query_start_loc: np.ndarray  # [S + 1]
    logits_indices: np.ndarray   # [N] rows of T whose logits are returned


def build_step_inputs(seqs: list[ScheduledSeq], block_size: int) -> StepInputs:
    """Pack the scheduled sequences' new tokens into one call's inputs (no padding tokens)."""
    if all(s.num_new_tokens == 1 and s.num_logits == 1 for s in seqs):
        return _decode_step_inputs(seqs, block_size)
    query_lens = np.fromiter((s.num_new_tokens for s in seqs), np.int64, len(seqs))
    starts = np.fromiter((s.start for s in seqs), np.int64, len(seqs))
    qsl = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    block_tables = _block_tables(seqs)
    input_ids = []
    for s in seqs:
        input_ids.extend(s.token_ids[s.start:s.start + s.num_new_tokens])
    seq_of_token = np.repeat(np.arange(len(seqs)), query_lens)
    positions = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1] - starts, query_lens)
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    num_logits = np.fromiter((s.num_logits for s in seqs), np.int64, len(seqs))
    rows = np.arange(int(num_logits.sum()), dtype=np.int64)
    ends = np.repeat(qsl[1:], num_logits)
    offsets = np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
    logits_indices = ends - num_logits.repeat(num_logits) + (rows - offsets)
    return StepInputs(np.asarray(input_ids, np.int64), positions, slot_mapping, block_tables,
                      starts, qsl, logits_indices)


def _block_tables(seqs: list[ScheduledSeq]) -> np.ndarray:
    """The sequences' block tables, ``[S, longest] int64``, zero-padded."""
    block_tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), np.int64)
    for i, s in enumerate(seqs):
        block_tables[i, :len(s.block_table)] = s.block_table
    return block_tables


def decode_step_inputs(num_seqs: int, width: int) -> StepInputs:
    """Zeroed inputs for a decode-only call of ``num_seqs`` sequences whose block tables are
    ``width`` blocks wide, for :func:`write_decode_step_inputs`; ``query_start_loc`` and
    ``logits_indices`` are already the call's (``arange``: token i, one logits row each)."""
    rows = np.arange(num_seqs + 1, dtype=np.int64)
    return StepInputs(*(np.zeros(num_seqs, np.int64) for _ in range(3)), np.zeros((num_seqs, width), np.int64),
                      np.zeros(num_seqs, np.int64), rows, rows[:num_seqs].copy())


def write_decode_step_inputs(seqs: list[ScheduledSeq], block_size: int, out: StepInputs) -> None:
    """Write a decode-only call's inputs (one new token and its logits per sequence; token i
    is sequence i's) into ``out``'s arrays in place (:func:`decode_step_inputs` of
    ``len(seqs)`` sequences and a width of at least the longest block table). A table row's
    entries past the table are left as they are: attention reads a row only as far as the
    sequence's context. One pass over the sequences, scalar writes: warm, 1.1 / 5.8 / 43 us at
    1 / 8 / 64 sequences, against 6.6 / 10.6 / 41 us through fromiter and fancy indexing."""
    ids, positions, slots, tables = out.input_ids, out.positions, out.slot_mapping, out.block_tables
    for i, s in enumerate(seqs):
        p, table = s.start, s.block_table
        ids[i] = s.token_ids[p]
        positions[i] = p
        slots[i] = table[p // block_size] * block_size + p % block_size
        tables[i, :len(table)] = table
    out.context_lens[:] = positions


def _decode_step_inputs(seqs: list[ScheduledSeq], block_size: int) -> StepInputs:
    """build_step_inputs for a step of decodes only (one new token and its logits each), in
    fewer numpy calls than the general packing."""
    inputs = decode_step_inputs(len(seqs), max(len(s.block_table) for s in seqs))
    write_decode_step_inputs(seqs, block_size, inputs)
    return inputs


def group_by_query_length(seqs: list[ScheduledSeq], max_padding: int = 1 << 14) -> list[list[int]]:
    """Split one step's sequences into graph calls whose attention padding stays small
    (ONNX Runtime without trtllm-lite's kernels: their C++ PagedAttention pads nothing, so
    with them every step is one call).

    The PagedAttention function body pads every sequence of a call to the call's longest
    query ``Q`` and attends each padded row to the call's longest key range ``L`` (cached
    context + ``Q``), while every extra call reads all the weights once more. Greedy over the
    sequences by decreasing query length: a sequence joins the current call while the padded
    rows times ``L``, ``(S * Q - T) * L``, stay within ``max_padding`` (row x key pairs;
    the default 16384 costs about what one more call, one more pass over SmolLM2's weights,
    costs: measured on 2 cores, one decode padded into four 128-token prompts, ~33k pairs,
    added 20-55 ms to the call, a separate decode call ~20 ms; 64 x 128/128 requests spent
    6.5-6.9 s instead of 7.6 s in their prompt steps with 16384 than with 65536). So a
    draft verification carries a few decodes in one call, but decodes are not padded to a
    prompt chunk (63 padded to a 512-token chunk: 1.5 GB of scores per layer, 3x slower).

    Returns:
        lists of indices into ``seqs``, each in ascending order; one list when nothing pads.
    """
    order = sorted(range(len(seqs)), key=lambda i: -seqs[i].num_new_tokens)
    groups: list[list[int]] = []
    longest = tokens = keys = 0
    for i in order:
        s = seqs[i]
        q, span = s.num_new_tokens, s.start + s.num_new_tokens
        if groups and ((len(groups[-1]) + 1) * longest - tokens - q) * max(keys, span) <= max_padding:
            groups[-1].append(i)
            tokens, keys = tokens + q, max(keys, span)
        else:
            groups.append([i])
            longest, tokens, keys = q, q, span
    return [sorted(g) for g in groups]


class ModelRunner(Protocol):
    """A backend. ``execute`` returns logits ``[batch.num_logits, vocab]`` float32;
    ``copy_blocks`` copies whole KV blocks ``src -> dst`` in every layer (copy-on-write)."""

    block_size: int
    num_blocks: int
    vocab_size: int

    def execute(self, batch: StepBatch) -> np.ndarray: ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...
