"""Launch the trtllm-lite CUDA kernels on device buffers (ctypes, no torch).

Every launch function takes device pointers as ints (from :class:`DeviceBuffer`, CuPy,
PyTorch's ``data_ptr()``, cuda-python), sizes, and a ``stream`` (a ``cudaStream_t`` handle as an
int; 0 = the legacy default stream). Launches are asynchronous; errors in the arguments or the
launch raise :class:`CudaKernelError`. Shapes (fp16/bf16 tensors, int64 metadata) are those of
the ``trtllm_lite::PagedAttention`` op, see ``builder/paged_attention.py``::

    query   [num_tokens, num_heads, head_dim]     key, value  [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping [num_tokens]   block_tables [num_seqs, max_blocks_per_seq]
    context_lens [num_seqs]     query_start_loc [num_seqs + 1]
    out     [num_tokens, num_heads, head_dim]

:func:`run_paged_attention` is a numpy-in / numpy-out convenience for tests and tools.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._library import DTYPE_CODES, check, load_library
from .device import DeviceBuffer, from_device_dtype, storage_dtype, synchronize, to_device_dtype


def _dtype_code(dtype: str) -> int:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_CODES)}, got {dtype!r}")
    return DTYPE_CODES[dtype]


def paged_kv_write(*, dtype: str, key: int, value: int, key_cache: int, value_cache: int,
                   slot_mapping: int, num_tokens: int, num_kv_heads: int, head_dim: int,
                   block_size: int, stream: int = 0) -> None:
    """Store the step's new K/V rows at their pool slots (slot < 0: skipped)."""
    lib = load_library()
    check(lib.tl_paged_kv_write(_dtype_code(dtype), key, value, key_cache, value_cache,
                                slot_mapping, num_tokens, num_kv_heads, head_dim, block_size,
                                stream), "tl_paged_kv_write")


def decode_workspace_size(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                          max_seq_len: int) -> int:
    """Bytes of scratch the split (flash-decoding) decode needs; 0 when it does not split."""
    return int(load_library().tl_decode_workspace_size(num_seqs, num_heads, num_kv_heads,
                                                       head_dim, max_seq_len))


def decode_num_splits(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      max_seq_len: int) -> int:
    """Splits of each sequence's context the decode kernel makes (flash-decoding; 1: no
    split), as the library picks them for this shape."""
    return int(load_library().tl_decode_num_splits(num_seqs, num_heads, num_kv_heads, head_dim,
                                                   max_seq_len))


def _tuning_int(name: str, value, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]`` (a C int), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def set_decode_policy(min_chunk: int = 0, ctas_per_sm: int = 0) -> None:
    """Tune the decode split (benchmarks): tokens per split at least ``min_chunk``; aim at
    ``ctas_per_sm`` thread blocks per multiprocessor. 0 restores the defaults.

    Raises:
        ValueError: either is negative, not an integer, or beyond a C int.
    """
    min_chunk = _tuning_int("min_chunk", min_chunk, 0, 2**31 - 1)
    ctas_per_sm = _tuning_int("ctas_per_sm", ctas_per_sm, 0, 2**31 - 1)
    load_library().tl_set_decode_policy(min_chunk, ctas_per_sm)


DECODE_KERNELS = {"pipelined": 0, "registers": 1, "mma": 2}


def set_decode_kernel(kernel: str = "mma") -> None:
    """Choose the decode split kernel: ``"mma"`` (tensor cores, fragments loaded straight from
    the pool; the default), ``"pipelined"`` (CUDA cores, cp.async through a shared-memory ring)
    or ``"registers"`` (CUDA cores, read-once loads into registers). Same results within
    rounding.

    Raises:
        ValueError: ``kernel`` is not one of those names.
    """
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {sorted(DECODE_KERNELS)}, got {kernel!r}")
    check(load_library().tl_set_decode_kernel(DECODE_KERNELS[kernel]), "tl_set_decode_kernel")


def set_decode_mma_prefetch(prefetch: int = -1) -> None:
    """Tune the ``"mma"`` decode kernel (benchmarks; same results): 1 loads a warp's next 16
    positions while it computes these, 0 does not, -1 restores the default (on for head_dim
    128, off for 64: the measured faster choice on an H200, docs/benchmarks.md).

    Raises:
        ValueError: ``prefetch`` is not -1, 0 or 1.
    """
    prefetch = _tuning_int("prefetch", prefetch, -1, 1)
    load_library().tl_set_decode_mma_prefetch(prefetch)


def paged_attention_decode(*, dtype: str, query: int, key_cache: int, value_cache: int, out: int,
                           block_tables: int, context_lens: int, num_seqs: int, num_heads: int,
                           num_kv_heads: int, head_dim: int, block_size: int,
                           max_blocks_per_seq: int, max_seq_len: int, scale: float,
                           workspace: int = 0, workspace_size: int = 0, stream: int = 0) -> None:
    """One query token per sequence; sequence s attends positions [0, context_lens[s] + 1)."""
    lib = load_library()
    check(lib.tl_paged_attention_decode(
        _dtype_code(dtype), query, key_cache, value_cache, out, block_tables, context_lens,
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq, max_seq_len,
        scale, workspace or None, workspace_size, stream), "tl_paged_attention_decode")


def paged_attention_prefill(*, dtype: str, query: int, key_cache: int, value_cache: int,
                            out: int, block_tables: int, context_lens: int, query_start_loc: int,
                            num_seqs: int, num_tokens: int, max_query_len: int, num_heads: int,
                            num_kv_heads: int, head_dim: int, block_size: int,
                            max_blocks_per_seq: int, scale: float, stream: int = 0) -> None:
    """Causal (chunked) prefill: token j of sequence s attends [0, context_lens[s] + j]."""
    lib = load_library()
    check(lib.tl_paged_attention_prefill(
        _dtype_code(dtype), query, key_cache, value_cache, out, block_tables, context_lens,
        query_start_loc, num_seqs, num_tokens, max_query_len, num_heads, num_kv_heads, head_dim,
        block_size, max_blocks_per_seq, scale, stream), "tl_paged_attention_prefill")


def paged_attention(*, dtype: str, query: int, key: int, value: int, key_cache: int,
                    value_cache: int, out: int, slot_mapping: int, block_tables: int,
                    context_lens: int, query_start_loc: int, num_seqs: int, num_tokens: int,
                    max_query_len: int, max_seq_len: int, num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, max_blocks_per_seq: int, scale: float,
                    workspace: int = 0, workspace_size: int = 0, stream: int = 0) -> None:
    """The whole op: KV write, then decode (all query lengths 1) or prefill attention."""
    lib = load_library()
    check(lib.tl_paged_attention(
        _dtype_code(dtype), query, key, value, key_cache, value_cache, out, slot_mapping,
        block_tables, context_lens, query_start_loc, num_seqs, num_tokens, max_query_len,
        max_seq_len, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq, scale,
        workspace or None, workspace_size, stream), "tl_paged_attention")


@dataclass
class PagedAttentionResult:
    """Host copies after :func:`run_paged_attention` (float32 values of the 16-bit results)."""
    output: np.ndarray       # [num_tokens, num_heads, head_dim]
    key_cache: np.ndarray    # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: np.ndarray


def check_step_metadata(block_tables: np.ndarray, context_lens: np.ndarray,
                        query_start_loc: np.ndarray, slot_mapping: np.ndarray, num_blocks: int,
                        block_size: int, num_tokens: int) -> None:
    """Host-side check of a step's metadata before the kernels read it unchecked.

    Shapes: block_tables ``[S, M]``, context_lens ``[S]``, query_start_loc ``[S + 1]``,
    slot_mapping ``[T]``, all int64. Sequence s reads positions ``[0, ctx_s + qlen_s)``.

    Raises:
        ValueError: naming the first bad input (see :func:`run_paged_attention`).
    """
    num_seqs, max_blocks = block_tables.shape
    if context_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"context_lens {context_lens.shape} / query_start_loc "
                         f"{query_start_loc.shape} do not match {num_seqs} block-table rows")
    qlens = np.diff(query_start_loc)
    if query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens or (qlens < 0).any():
        raise ValueError(f"query_start_loc must rise from 0 to {num_tokens} tokens, got "
                         f"{query_start_loc.tolist()}")
    capacity = max_blocks * block_size
    if (context_lens < 0).any() or (context_lens > capacity).any():   # before any sum can overflow
        raise ValueError(f"context_lens must be in [0, {capacity}] (the block-table rows' "
                         f"positions), got {context_lens.tolist()}")
    spans = context_lens + qlens
    if (spans > capacity).any():
        s = int(np.argmax(spans > capacity))
        raise ValueError(f"sequence {s} reads {int(spans[s])} positions but its block-table row "
                         f"holds {max_blocks} blocks of {block_size}")
    used = np.arange(max_blocks)[None, :] < -(-spans // block_size)[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        s, b = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"block_tables[{s}, {b}] = {int(block_tables[s, b])} is outside the "
                         f"pool's {num_blocks} blocks")
    if slot_mapping.shape != (num_tokens,) or (slot_mapping >= num_blocks * block_size).any():
        raise ValueError(f"slot_mapping must hold {num_tokens} slots below {num_blocks * block_size}")


def run_paged_attention(query, key, value, key_cache, value_cache, slot_mapping, block_tables,
                        context_lens, query_start_loc, scale: float, dtype: str = "float16",
                        mode: str = "auto", poison_output: bool = True,
                        max_query_len: int | None = None,
                        max_seq_len: int | None = None) -> PagedAttentionResult:
    """Run the op on numpy arrays (float inputs are rounded to ``dtype``) and copy results back.

    ``mode``: ``"auto"`` (the op's own choice), ``"decode"`` or ``"prefill"`` (force a kernel).
    With ``poison_output`` the output starts as NaN, so unwritten elements show.
    ``max_query_len`` / ``max_seq_len`` override the bounds computed from the metadata.

    Raises:
        ValueError: metadata the kernels would follow out of the pool (they read it
            unchecked on the device): a context length below 0, a sequence longer than its
            block-table row, a block id it uses outside ``[0, num_blocks)``, offsets that do
            not cover the tokens, a slot past the pool, tensors whose shapes disagree, a
            decode (``mode="decode"``, or ``"auto"`` with ``max_query_len`` 1) whose
            sequences do not have exactly one token each.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs, max_blocks = block_tables.shape
    kv_shape = (num_tokens, num_kv_heads, head_dim)
    if key.shape != kv_shape or value.shape != kv_shape or value_cache.shape != key_cache.shape \
            or key_cache.shape[3] != head_dim:
        raise ValueError(f"shapes disagree: query {query.shape}, key {key.shape}, value {value.shape}, "
                         f"key_cache {key_cache.shape}, value_cache {value_cache.shape} (expected key / "
                         f"value {kv_shape}, caches [num_blocks, block_size, {num_kv_heads}, {head_dim}])")
    qsl = np.asarray(query_start_loc, np.int64)
    ctx = np.asarray(context_lens, np.int64)
    check_step_metadata(np.asarray(block_tables, np.int64), ctx, qsl,
                        np.asarray(slot_mapping, np.int64), num_blocks, block_size, num_tokens)
    qlens = np.diff(qsl)
    if max_query_len is None:
        max_query_len = int(np.max(qlens)) if num_seqs else 0
    if max_seq_len is None:
        max_seq_len = int(np.max(ctx + qlens)) if num_seqs else 0
    decodes = mode == "decode" or (mode == "auto" and num_tokens == num_seqs and max_query_len == 1)
    if decodes and (qlens != 1).any():   # the decode kernels read ctx + 1 positions each
        raise ValueError("decode needs exactly one query token per sequence (query_start_loc "
                         f"{qsl.tolist()}); max_query_len={max_query_len} says otherwise")
    dev = {name: DeviceBuffer.from_array(to_device_dtype(arr, dtype)) for name, arr in
           dict(query=query, key=key, value=value, key_cache=key_cache,
                value_cache=value_cache).items()}
    for name, arr in dict(slot_mapping=slot_mapping, block_tables=block_tables,
                          context_lens=ctx, query_start_loc=qsl).items():
        dev[name] = DeviceBuffer.from_array(np.asarray(arr, np.int64))
    out = DeviceBuffer(query.size * 2)
    if poison_output:
        out.fill_bytes(0xFF)
    ws_size = decode_workspace_size(num_seqs, num_heads, num_kv_heads, head_dim, max_seq_len)
    ws = DeviceBuffer(ws_size) if ws_size else None
    ptr = {k: v.ptr for k, v in dev.items()}
    common = dict(dtype=dtype, query=ptr["query"], key_cache=ptr["key_cache"],
                  value_cache=ptr["value_cache"], out=out.ptr, block_tables=ptr["block_tables"],
                  context_lens=ptr["context_lens"], num_seqs=num_seqs, num_heads=num_heads,
                  num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                  max_blocks_per_seq=max_blocks, scale=scale)
    if mode == "auto":
        paged_attention(**common, key=ptr["key"], value=ptr["value"],
                        slot_mapping=ptr["slot_mapping"], query_start_loc=ptr["query_start_loc"],
                        num_tokens=num_tokens, max_query_len=max_query_len,
                        max_seq_len=max_seq_len, workspace=ws.ptr if ws else 0,
                        workspace_size=ws_size)
    else:
        paged_kv_write(dtype=dtype, key=ptr["key"], value=ptr["value"],
                       key_cache=ptr["key_cache"], value_cache=ptr["value_cache"],
                       slot_mapping=ptr["slot_mapping"], num_tokens=num_tokens,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
        if mode == "decode":
            paged_attention_decode(**common, max_seq_len=max_seq_len,
                                   workspace=ws.ptr if ws else 0, workspace_size=ws_size)
        elif mode == "prefill":
            paged_attention_prefill(**common, query_start_loc=ptr["query_start_loc"],
                                    num_tokens=num_tokens, max_query_len=max_query_len)
        else:
            raise ValueError(f"mode must be auto, decode or prefill, got {mode!r}")
    synchronize()
    sdt = storage_dtype(dtype)
    return PagedAttentionResult(
        output=from_device_dtype(out.download(query.shape, sdt), dtype),
        key_cache=from_device_dtype(dev["key_cache"].download(key_cache.shape, sdt), dtype),
        value_cache=from_device_dtype(dev["value_cache"].download(value_cache.shape, sdt), dtype))
