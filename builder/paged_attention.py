"""The ``trtllm_lite::PagedAttention`` op: schema, numpy reference and ONNX function body.

One node per decoder layer. It attends the step's query tokens to their sequence's
cached context (read through the block table) plus the step's own earlier tokens.

Schema (domain ``trtllm_lite``, version 1)::

    inputs
      0 query            [num_tokens, num_heads, head_dim]                  float
      1 key              [num_tokens, num_kv_heads, head_dim]               float  new K (rotary applied)
      2 value            [num_tokens, num_kv_heads, head_dim]               float  new V
      3 key_cache        [num_blocks, block_size, num_kv_heads, head_dim]   float  this layer's K pool
      4 value_cache      [num_blocks, block_size, num_kv_heads, head_dim]   float  this layer's V pool
      5 slot_mapping     [num_tokens]                     int64  flat pool slot of each new token
      6 block_tables     [num_seqs, max_blocks_per_seq]   int64  logical -> physical block
      7 context_lens     [num_seqs]                       int64  tokens already cached before the step
      8 query_start_loc  [num_seqs + 1]                   int64  packed offsets of each sequence's tokens
    attributes
      num_heads, num_kv_heads (int), scale (float, usually head_dim ** -0.5)
    outputs
      0 output           [num_tokens, num_heads, head_dim]                  float

Token ``t`` of sequence ``s`` (``j = t - query_start_loc[s]``) sits at position
``p = context_lens[s] + j``; it attends to cached positions ``[0, context_lens[s])`` and to
the step's tokens of ``s`` with index ``<= j`` (causal). Query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)`` (GQA; MQA and MHA are the edge cases).

Block table layout (block_size B)::

    position p of sequence s  ->  block_tables[s, p // B], offset p % B
    slot = block_tables[s, p // B] * B + p % B          (= slot_mapping for new tokens)

How the new K/V reach the pool: the op owns the write in its contract. Its ONNX function
body (run by ONNX Runtime and TensorRT-RTX) cannot mutate an input, so there the graph also
returns every layer's new K/V and the runtime stores them at ``slot_mapping`` (cost grows
with the step's tokens, never with the pool). The CUDA plugin writes them in place.
"""
from __future__ import annotations

import numpy as np

DOMAIN = "trtllm_lite"
OP_TYPE = "PagedAttention"
OP_VERSION = 1

INPUT_NAMES = (
    "query", "key", "value", "key_cache", "value_cache",
    "slot_mapping", "block_tables", "context_lens", "query_start_loc",
)


def write_kv_reference(key_cache: np.ndarray, value_cache: np.ndarray, key: np.ndarray,
                       value: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Store new K/V in the pools in place (the paged KV write).

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int, flat slot ``block * block_size + offset``.
    """
    nb, bs, hkv, d = key_cache.shape
    key_cache.reshape(nb * bs, hkv, d)[slot_mapping] = key
    value_cache.reshape(nb * bs, hkv, d)[slot_mapping] = value


def reference_paged_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray,
                              key_cache: np.ndarray, value_cache: np.ndarray,
                              block_tables: np.ndarray, context_lens: np.ndarray,
                              query_start_loc: np.ndarray, scale: float) -> np.ndarray:
    """Plain float64 numpy reference of the op (no writes to the pools).

    Shapes as in the module docstring. Returns ``[num_tokens, num_heads, head_dim]``
    in ``query``'s dtype. Loops over sequences; meant for tests, not speed.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    out = np.zeros((num_tokens, num_heads, head_dim), dtype=np.float64)
    for s in range(len(context_lens)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        ctx = int(context_lens[s])
        pos = np.arange(ctx)
        blocks = block_tables[s][pos // block_size]
        k_ctx = key_cache[blocks, pos % block_size].astype(np.float64)
        v_ctx = value_cache[blocks, pos % block_size].astype(np.float64)
        k_all = np.concatenate([k_ctx, key[start:end].astype(np.float64)])
        v_all = np.concatenate([v_ctx, value[start:end].astype(np.float64)])
        for j in range(end - start):
            visible = ctx + j + 1
            for h in range(num_heads):
                kv = h // group
                scores = k_all[:visible, kv] @ query[start + j, h].astype(np.float64) * scale
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                out[start + j, h] = probs @ v_all[:visible, kv]
    return out.astype(query.dtype)
