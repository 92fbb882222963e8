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


def make_onnx_function(opset: int | None = None):
    """The op as a model-local ONNX function whose body uses standard ops only.

    ONNX Runtime and TensorRT-RTX inline this body. Layout inside (S sequences, Q the
    longest query length in the step, Lc the cached positions gathered, G = heads per KV head)::

        query [T, H, D] --gather by pad index--> [S, Q, H, D]       (packed -> padded)
        key_cache --gather block_tables[:, :ceil(max ctx / B)]--> [S, Lc, Hkv, D]
        keys = concat(cached [S, Lc], new [S, Q])                    along positions
        scores [S, Hkv, G*Q, Lc+Q] = q @ keys^T * scale; masked: cached l < ctx_s, new l <= j
        out = softmax(scores) @ values --gather by unpad index--> [T, H, D]

    The gathered context grows with the longest context in the step, never with the pool.
    """
    import onnx
    from onnx import AttributeProto, helper

    from .onnx_graph import OPSET, NodeWriter

    w = NodeWriter("pa_")
    i64 = lambda v: w.const(v)  # noqa: E731
    q, k, v, kc, vc, _slots, bt, ctx, qsl = INPUT_NAMES
    zero, one, neg1 = i64([0]), i64([1]), i64([-1])
    zero_s, one_s = i64(0), i64(1)

    # --- sizes
    num_seqs = w.op("Shape", ctx)                                   # [1] = S
    num_tokens = w.op("Shape", q, start=0, end=1)                   # [1] = T
    heads = w.op("Shape", q, start=1, end=2)                        # [1] = H
    kv_heads = w.op("Shape", k, start=1, end=2)                     # [1] = Hkv
    kv_hd = w.op("Shape", k, start=1)                               # [2] = Hkv, D
    head_dim = w.op("Shape", q, start=2)                            # [1] = D
    block = w.op("Shape", kc, start=1, end=2)                       # [1] = B
    group = w.op("Div", heads, kv_heads)                            # [1] = G

    # --- padded query index: pad_idx[s, j] = qsl[s] + min(j, qlen_s - 1)
    qsl_lo = w.op("Slice", qsl, zero, neg1)                         # [S]
    qsl_hi = w.op("Slice", qsl, one, i64([2**62]))                  # [S]
    qlens = w.op("Sub", qsl_hi, qsl_lo)                             # [S]
    qmax = w.op("ReduceMax", qlens, keepdims=1)                     # [1]
    j = w.op("Range", zero_s, w.op("Squeeze", qmax), one_s)         # [Q]
    last = w.op("Sub", w.op("Unsqueeze", qlens, one), one)          # [S, 1]
    pad_idx = w.op("Add", w.op("Unsqueeze", qsl_lo, one),
                   w.op("Min", w.op("Unsqueeze", j, zero), last))   # [S, Q]
    q_pad = w.op("Gather", q, pad_idx, axis=0)                      # [S, Q, H, D]
    k_new = w.op("Gather", k, pad_idx, axis=0)                      # [S, Q, Hkv, D]
    v_new = w.op("Gather", v, pad_idx, axis=0)

    # --- cached context through the block table (at least one block, masked if unused)
    max_ctx = w.op("ReduceMax", ctx, keepdims=1)                    # [1]
    ctx_blocks = w.op("Max", w.op("Div", w.op("Add", max_ctx, w.op("Sub", block, one)), block), one)
    bt_used = w.op("Slice", bt, zero, ctx_blocks, one)              # [S, Mc]
    ctx_shape = w.op("Concat", num_seqs, neg1, kv_hd, axis=0)       # [S, -1, Hkv, D]
    k_ctx = w.op("Reshape", w.op("Gather", kc, bt_used, axis=0), ctx_shape)  # [S, Lc, Hkv, D]
    v_ctx = w.op("Reshape", w.op("Gather", vc, bt_used, axis=0), ctx_shape)
    keys = w.op("Concat", k_ctx, k_new, axis=1)                     # [S, Lc+Q, Hkv, D]
    values = w.op("Concat", v_ctx, v_new, axis=1)

    # --- mask [S, Q, Lc+Q]: cached position l valid if l < ctx_s; new j' valid if j' <= j
    lc = w.op("Mul", ctx_blocks, block)                             # [1]
    lpos = w.op("Range", zero_s, w.op("Squeeze", lc), one_s)        # [Lc]
    ctx_ok = w.op("Less", w.op("Unsqueeze", lpos, zero), w.op("Unsqueeze", ctx, one))  # [S, Lc]
    ctx_ok = w.op("Expand", w.op("Unsqueeze", ctx_ok, one), w.op("Concat", num_seqs, qmax, lc, axis=0))
    new_ok = w.op("LessOrEqual", w.op("Unsqueeze", j, zero), w.op("Unsqueeze", j, one))  # [Q, Q]
    new_ok = w.op("Expand", w.op("Unsqueeze", new_ok, zero), w.op("Concat", num_seqs, qmax, qmax, axis=0))
    mask = w.op("Unsqueeze", w.op("Concat", ctx_ok, new_ok, axis=2), i64([1, 2]))  # [S,1,1,Q,L]
    # additive bias (0 / -inf): one broadcast Add on the scores is much cheaper than Where
    bias = w.op("Where", mask, w.const(0.0, np.float32), w.const(-np.inf, np.float32))

    # --- scores and softmax, grouped by KV head: [S, Hkv, G*Q, L]
    q5 = w.op("Reshape", q_pad, w.op("Concat", num_seqs, qmax, kv_heads, group, head_dim, axis=0))
    q4 = w.op("Reshape", w.op("Transpose", q5, perm=[0, 2, 3, 1, 4]),
              w.op("Concat", num_seqs, kv_heads, neg1, head_dim, axis=0))       # [S, Hkv, G*Q, D]
    k_t = w.op("Transpose", keys, perm=[0, 2, 3, 1])                            # [S, Hkv, D, L]
    scale = w.op("Constant", outputs=1)
    w.nodes[-1].attribute.append(AttributeProto(name="value_float", ref_attr_name="scale",
                                                type=AttributeProto.FLOAT))
    scores = w.op("Mul", w.op("MatMul", q4, k_t), scale)
    scores5 = w.op("Reshape", scores, w.op("Concat", num_seqs, kv_heads, group, qmax, neg1, axis=0))
    probs = w.op("Softmax", w.op("Add", scores5, bias), axis=-1)               # [S, Hkv, G, Q, L]
    probs4 = w.op("Reshape", probs, w.op("Concat", num_seqs, kv_heads, neg1, w.op("Shape", keys, start=1, end=2), axis=0))
    o = w.op("MatMul", probs4, w.op("Transpose", values, perm=[0, 2, 1, 3]))   # [S, Hkv, G*Q, D]
    o5 = w.op("Reshape", o, w.op("Concat", num_seqs, kv_heads, group, qmax, head_dim, axis=0))
    o_pad = w.op("Reshape", w.op("Transpose", o5, perm=[0, 3, 1, 2, 4]),
                 w.op("Concat", neg1, heads, head_dim, axis=0))                # [S*Q, H, D]

    # --- unpad: token t of sequence s -> s * Q + (t - qsl[s])
    t = w.op("Range", zero_s, w.op("Squeeze", num_tokens), one_s)              # [T]
    seq_of_t = w.op("ReduceSum", w.op("Cast", w.op("GreaterOrEqual", w.op("Unsqueeze", t, one),
                                                    w.op("Unsqueeze", qsl_hi, zero)), to=onnx.TensorProto.INT64),
                    one, keepdims=0)                                           # [T]
    unpad = w.op("Add", w.op("Mul", seq_of_t, qmax), w.op("Sub", t, w.op("Gather", qsl_lo, seq_of_t, axis=0)))
    w.op("Gather", o_pad, unpad, axis=0, outputs=["output"])

    return helper.make_function(
        DOMAIN, OP_TYPE, list(INPUT_NAMES), ["output"], w.nodes,
        [helper.make_opsetid("", opset or OPSET)],
        attributes=["num_heads", "num_kv_heads", "scale"])
