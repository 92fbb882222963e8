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
                         (pools: float32 or float16, build's kv_cache_dtype; the op reads
                         float16 rows as float32, and computes in float32; with float16
                         pools it attends the step's new K/V rounded to float16 too, as
                         vLLM's kernels read them back from the cache, so it attends the
                         same values however a prompt was chunked or cached)
      5 slot_mapping     [num_tokens]                     int64  flat pool slot of each new token
      6 block_tables     [num_seqs, max_blocks_per_seq]   int64  logical -> physical block
      7 context_lens     [num_seqs]                       int64  tokens already cached before the step
      8 query_start_loc  [num_seqs + 1]                   int64  packed offsets of each sequence's tokens
      9-22 (optional) the step's attention metadata, shared by every layer (like vLLM's
           ``AttentionMetadata``): ``pad_index``, ``unpad_index``, ``ctx_block_ids``,
           ``attn_bias`` and (ONNX Runtime's decode path) the decode tensors and the kernel
           choice, all functions of inputs 6-8 (:func:`write_attention_metadata`)
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

from trtllm_lite.engine_dir import FLOAT16_MAX, check_kv_cache_dtype_name, clip_to_float16_range

DOMAIN = "trtllm_lite"
OP_TYPE = "PagedAttention"
OP_VERSION = 1
DECODE_OP_TYPE = "PagedDecodeAttention"   # the decode step alone (make_decode_function)

INPUT_NAMES = (
    "query", "key", "value", "key_cache", "value_cache",
    "slot_mapping", "block_tables", "context_lens", "query_start_loc",
)
RAGGED_NAMES = ("ragged_block_ids", "ragged_owner", "ragged_pad_map", "ragged_bias", "ragged_seg")
METADATA_NAMES = ("pad_index", "unpad_index", "ctx_block_ids", "attn_bias", "decode_bias", "decode_split",
                  *RAGGED_NAMES, "use_padded_decode", "is_decode", "is_one_sequence")
DECODE_INPUT_NAMES = ("query", "key", "value", "key_cache", "value_cache", "block_tables", "context_lens",
                      "ctx_block_ids", "decode_bias", "decode_split", *RAGGED_NAMES, "use_padded_decode")
NUM_DECODE_METADATA = len(METADATA_NAMES)    # the ONNX Runtime graphs' decode path takes them all
GQA_HEAD_DIM_MULTIPLE = 8   # ONNX Runtime's CPU GroupQueryAttention: head_size % 8 == 0


def _cast_cache(kv_cache_dtype: str) -> bool:
    """Whether a function body for pools of ``kv_cache_dtype`` casts what it gathers to float32.

    Raises:
        ValueError: ``kv_cache_dtype`` is not in :data:`KV_CACHE_DTYPES`.
    """
    return check_kv_cache_dtype_name(kv_cache_dtype) == "float16"


def _gather_blocks(w, cache: str, block_ids: str, cast: bool) -> str:
    """``Gather(cache, block_ids, axis=0)``: whole blocks of a pool; with ``cast`` (float16
    pools) cast to float32, so only the gathered context is converted, never the pool, and
    float32 engines' bodies have no Cast at all."""
    from onnx import TensorProto

    gathered = w.op("Gather", cache, block_ids, axis=0)
    return w.op("Cast", gathered, to=TensorProto.FLOAT) if cast else gathered


def to_float16_saturated(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to float16 (nearest, ties to even) as a float16 pool stores K/V: values
    past float16's range saturate at +-65504 instead of becoming inf (NaN stays NaN)."""
    return clip_to_float16_range(x).astype(np.float16)


def write_kv_reference(key_cache: np.ndarray, value_cache: np.ndarray, key: np.ndarray,
                       value: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Store new K/V in the pools in place (the paged KV write).

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, float32
            or float16 (build's kv_cache_dtype: K/V stored as the runtime stores them, rounded
            to nearest even and saturated at +-65504: :func:`to_float16_saturated`).
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int, flat slot ``block * block_size + offset``.
    """
    nb, bs, hkv, d = key_cache.shape
    if key_cache.dtype == np.float16:
        key, value = to_float16_saturated(key), to_float16_saturated(value)
    key_cache.reshape(nb * bs, hkv, d)[slot_mapping] = key
    value_cache.reshape(nb * bs, hkv, d)[slot_mapping] = value


def reference_paged_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray,
                              key_cache: np.ndarray, value_cache: np.ndarray,
                              block_tables: np.ndarray, context_lens: np.ndarray,
                              query_start_loc: np.ndarray, scale: float) -> np.ndarray:
    """Plain float64 numpy reference of the op (no writes to the pools).

    Shapes as in the module docstring (pools float32 or float16, read as float64; with
    float16 pools the step's new K/V are rounded to float16 first, as the op attends them: what
    the pool will hold). Returns ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    Loops over sequences; meant for tests, not speed.
    """
    if key_cache.dtype == np.float16:
        key, value = (to_float16_saturated(x) for x in (key, value))
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


def write_attention_metadata(w, block_tables: str, context_lens: str, query_start_loc: str,
                             block_size: str, group: str, decode_heads: tuple[int, int] | None = None
                             ) -> tuple[str, ...]:
    """Write the nodes that turn the step's block tables and offsets into attention metadata.

    Every layer's attention needs the same index and mask tensors; computed once per graph
    (vLLM builds its ``AttentionMetadata`` once per step the same way) they cost a few dozen
    small ops per step instead of per layer. ``block_size`` and ``group`` (query heads per KV
    head) name ``[1]`` int64 tensors. With S sequences, Q the longest query length in the
    step, Mc = max(ceil(max context / block_size), 1) and L = Mc * block_size + Q:

        pad_index      [S, Q]            int64  packed token of padded row (s, j): qsl[s] + min(j, qlen_s - 1)
        unpad_index    [T]               int64  padded row of packed token t: s * Q + (t - qsl[s])
        ctx_block_ids  [S, Mc]           int64  block_tables[:, :Mc]
        attn_bias      [S, 1, G * Q, L]  float32  0 where row j of s sees position l (cached
                                         l < ctx_s; new l - Mc * B <= j), else -inf;
                                         rows g * Q + j repeat the Q rows for each of G heads
        decode_bias    [S, H, (Mc * B + 1) * Hkv]  float32  (only with ``decode_heads``) the
                                         decode path's bias over (position, KV head) pairs:
                                         0 where query head h reads KV head h // G at a cached
                                         position < ctx_s or at the new token (the last), else -inf
        decode_split   [2]               int64  [Mc * B * Hkv, Hkv]: its cached and new columns

    With ``decode_heads``, also the ragged decode path's metadata over the NBt context blocks
    the sequences really use (sequence-major; NonZero of ``j < ceil(ctx_s / B)``), no padding
    to the longest context:

        ragged_block_ids [NBt]            int64  physical block of ragged block b
        ragged_owner     [NBt]            int64  its sequence
        ragged_pad_map   [S, Mc]          int64  ragged index of (s, j), NBt where j is past s's blocks
        ragged_bias      [NBt, H, B * Hkv]  float32  decode_bias's rule within block b
        ragged_seg       [S, NBt]         float32  1 where block b belongs to sequence s

    and the kernel choice, made once per step instead of per layer (``If`` conditions):

        use_padded_decode [1]  bool  T == S and not ragged, where ragged = NBt > 0 and padding
                                     to the longest context would waste over 1/4 of S * Mc
        is_decode         [1]  bool  T == S (every sequence computes one token)
        is_one_sequence   [1]  bool  S == 1

    ``decode_heads``: ``(num_heads, num_kv_heads)`` to also write the decode metadata.
    Returns the tensor names in :data:`METADATA_NAMES` order (four without ``decode_heads``).
    """
    import onnx

    i64 = lambda v: w.const(v)  # noqa: E731
    bt, ctx, qsl = block_tables, context_lens, query_start_loc
    zero, one, neg1 = i64([0]), i64([1]), i64([-1])
    zero_s, one_s = i64(0), i64(1)

    qsl_lo = w.op("Slice", qsl, zero, neg1)                         # [S]
    qsl_hi = w.op("Slice", qsl, one, i64([2**62]))                  # [S]
    qlens = w.op("Sub", qsl_hi, qsl_lo)                             # [S]
    qmax = w.op("ReduceMax", qlens, keepdims=1)                     # [1] = Q
    j = w.op("Range", zero_s, w.op("Squeeze", qmax, zero), one_s)   # [Q]
    last = w.op("Sub", w.op("Unsqueeze", qlens, one), one)          # [S, 1]
    pad_index = w.op("Add", w.op("Unsqueeze", qsl_lo, one),
                     w.op("Min", w.op("Unsqueeze", j, zero), last))  # [S, Q]

    max_ctx = w.op("ReduceMax", ctx, keepdims=1)                    # [1]
    ctx_blocks = w.op("Max", w.op("Div", w.op("Add", max_ctx, w.op("Sub", block_size, one)), block_size), one)
    ctx_block_ids = w.op("Slice", bt, zero, ctx_blocks, one)        # [S, Mc]

    # mask [S, Q, L]: cached position l valid if l < ctx_s; new j' valid if j' <= j
    num_seqs = w.op("Shape", ctx)                                   # [1] = S
    lc = w.op("Mul", ctx_blocks, block_size)                        # [1]
    lpos = w.op("Range", zero_s, w.op("Squeeze", lc, zero), one_s)  # [Lc]
    ctx_ok = w.op("Less", w.op("Unsqueeze", lpos, zero), w.op("Unsqueeze", ctx, one))  # [S, Lc]
    ctx_ok = w.op("Expand", w.op("Unsqueeze", ctx_ok, one), w.op("Concat", num_seqs, qmax, lc, axis=0))
    new_ok = w.op("LessOrEqual", w.op("Unsqueeze", j, zero), w.op("Unsqueeze", j, one))  # [Q, Q]
    new_ok = w.op("Expand", w.op("Unsqueeze", new_ok, zero), w.op("Concat", num_seqs, qmax, qmax, axis=0))
    mask = w.op("Unsqueeze", w.op("Concat", ctx_ok, new_ok, axis=2), one)   # [S, 1, Q, L]
    # additive bias (0 / -inf): one broadcast Add on the scores is much cheaper than Where
    bias = w.op("Where", mask, w.const(0.0, np.float32), w.const(-np.inf, np.float32))
    attn_bias = w.op("Tile", bias, w.op("Concat", one, one, group, one, axis=0))   # [S, 1, G*Q, L]

    # unpad: token t of sequence s -> s * Q + (t - qsl[s])
    num_tokens = w.op("Slice", qsl, neg1, i64([2**62]))             # [1] = T
    t = w.op("Range", zero_s, w.op("Squeeze", num_tokens, zero), one_s)  # [T]
    seq_of_t = w.op("ReduceSum", w.op("Cast", w.op("GreaterOrEqual", w.op("Unsqueeze", t, one),
                                                    w.op("Unsqueeze", qsl_hi, zero)), to=onnx.TensorProto.INT64),
                    one, keepdims=0)                                # [T]
    unpad_index = w.op("Add", w.op("Mul", seq_of_t, qmax), w.op("Sub", t, w.op("Gather", qsl_lo, seq_of_t, axis=0)))
    if decode_heads is None:
        return pad_index, unpad_index, ctx_block_ids, attn_bias

    # decode_bias [S, H, (Lc + 1) * Hkv]: position l < ctx_s or l == Lc (the new token), and
    # KV head k == h // G
    # as the sum of a position bias repeated per KV head, [S, 1, L * Hkv], and a head bias
    # repeated per position, [1, H, L * Hkv]: both small, and their Add broadcasts over whole
    # rows (measured: a [S, 1, L, 1] + [1, H, 1, Hkv] broadcast, inner size Hkv, took ~3 ms at
    # S = 64, L = 257; 0 + -inf and -inf + -inf are -inf)
    num_heads, num_kv_heads = decode_heads
    lpos1 = w.op("Range", zero_s, w.op("Squeeze", w.op("Add", lc, one), zero), one_s)   # [Lc + 1]
    pos_ok = w.op("Or", w.op("Less", w.op("Unsqueeze", lpos1, zero), w.op("Unsqueeze", ctx, one)),
                  w.op("Unsqueeze", w.op("Equal", lpos1, lc), zero))               # [S, L]
    pos_bias = w.op("Where", w.op("Unsqueeze", pos_ok, i64([2])), w.const(0.0, np.float32),
                    w.const(-np.inf, np.float32))                                  # [S, L, 1]
    pos_rows = w.op("Reshape", w.op("Expand", pos_bias, i64([1, 1, num_kv_heads])), i64([0, 1, -1]))
    group_size = num_heads // num_kv_heads
    head_ok = np.arange(num_heads)[:, None] // group_size == np.arange(num_kv_heads)[None, :]
    head_bias = w.const(np.where(head_ok, 0.0, -np.inf)[None], np.float32)         # [1, H, Hkv]
    head_rows = w.op("Tile", head_bias, w.op("Concat", one, one, w.op("Add", lc, one), axis=0))
    decode_bias = w.op("Add", pos_rows, head_rows)                                 # [S, H, L * Hkv]
    *ragged, ragged_pays = _write_ragged_metadata(w, ctx, ctx_block_ids, ctx_blocks, block_size, num_seqs,
                                                  head_bias)
    is_decode = w.op("Equal", num_tokens, num_seqs)
    use_padded_decode = w.op("And", is_decode, w.op("Not", ragged_pays))
    is_one_sequence = w.op("Equal", num_seqs, one)
    decode_split = w.op("Concat", w.op("Mul", lc, i64([num_kv_heads])), i64([num_kv_heads]), axis=0)
    return (pad_index, unpad_index, ctx_block_ids, attn_bias, decode_bias, decode_split, *ragged,
            use_padded_decode, is_decode, is_one_sequence)


def _write_ragged_metadata(w, ctx: str, ctx_block_ids: str, ctx_blocks: str, block_size: str,
                           num_seqs: str, head_bias: str) -> tuple[str, ...]:
    """The ragged decode path's metadata (see :func:`write_attention_metadata`) and whether
    it pays: NBt > 0 and padding would waste over a quarter of the blocks."""
    import onnx

    i64 = lambda v: w.const(v)  # noqa: E731
    zero, one, zero_s, one_s = i64([0]), i64([1]), i64(0), i64(1)
    blocks = w.op("Div", w.op("Add", ctx, w.op("Sub", block_size, one)), block_size)   # [S] ceil(ctx / B)
    j = w.op("Range", zero_s, w.op("Squeeze", ctx_blocks, zero), one_s)                # [Mc]
    used = w.op("Less", w.op("Unsqueeze", j, zero), w.op("Unsqueeze", blocks, one))     # [S, Mc]
    used_flat = w.op("Reshape", used, i64([-1]))
    flat = w.op("Squeeze", w.op("NonZero", used_flat), zero)                           # [NBt] = s * Mc + j
    block_ids = w.op("Gather", w.op("Reshape", ctx_block_ids, i64([-1])), flat, axis=0)
    owner = w.op("Div", flat, ctx_blocks)
    first = w.op("Mul", w.op("Sub", flat, w.op("Mul", owner, ctx_blocks)), block_size)  # [NBt] first position
    # row r of a block's B * Hkv rows holds position first + r // Hkv (built without a
    # Reshape: ONNX Runtime folds one into a -1 shape that fails when NBt is 0)
    num_kv_heads = w.op("Shape", head_bias, start=2, end=3)
    row_width = w.op("Squeeze", w.op("Mul", block_size, num_kv_heads), zero)
    row_pos = w.op("Div", w.op("Range", zero_s, row_width, one_s), num_kv_heads)        # [B * Hkv]
    pos_ok = w.op("Less", w.op("Add", w.op("Unsqueeze", first, one), w.op("Unsqueeze", row_pos, zero)),
                  w.op("Unsqueeze", w.op("Gather", ctx, owner, axis=0), one))           # [NBt, B * Hkv]
    pos_rows = w.op("Where", w.op("Unsqueeze", pos_ok, one), w.const(0.0, np.float32),
                    w.const(-np.inf, np.float32))                                      # [NBt, 1, B * Hkv]
    head_rows = w.op("Tile", head_bias, w.op("Concat", one, one, block_size, axis=0))  # [1, H, B * Hkv]
    ragged_bias = w.op("Add", pos_rows, head_rows)                                     # [NBt, H, B * Hkv]
    num_ragged = w.op("Shape", flat)                                                   # [1] = NBt
    ragged_index = w.op("Sub", w.op("CumSum", w.op("Cast", used_flat, to=onnx.TensorProto.INT64), zero), one_s)
    pad_map = w.op("Where", used, w.op("Reshape", ragged_index, w.op("Shape", used)), num_ragged)  # [S, Mc]
    seqs = w.op("Range", zero_s, w.op("Squeeze", num_seqs, zero), one_s)                # [S]
    seg = w.op("Cast", w.op("Equal", w.op("Unsqueeze", seqs, one), w.op("Unsqueeze", owner, zero)),
               to=onnx.TensorProto.FLOAT)                                              # [S, NBt]
    padded = w.op("Mul", num_seqs, ctx_blocks)
    pays = w.op("And", w.op("Greater", num_ragged, zero),
                w.op("Less", w.op("Mul", num_ragged, i64([4])), w.op("Mul", padded, i64([3]))))
    return block_ids, owner, pad_map, ragged_bias, seg, pays


def _write_attention(w, q, k, v, kc, vc, metadata, dims, scale: str, output: str,
                     cast_cache: bool = False) -> None:
    """The attention over gathered context blocks (see :func:`make_onnx_function`).

    ``dims``: ``heads``, ``kv_heads``, ``group``, ``head_dim`` as ``[1]`` int64 tensor names
    (constants when known at export, else read from the inputs' shapes). ``cast_cache``:
    float16 pools, whose gathered blocks are cast to float32 (:func:`_gather_blocks`).
    """
    pad_index, unpad_index, ctx_block_ids, attn_bias = metadata
    zero, neg1 = w.const([0]), w.const([-1])
    h, hkv, g, d = dims["heads"], dims["kv_heads"], dims["group"], dims["head_dim"]
    q_pad = w.op("Gather", q, pad_index, axis=0)                                # [S, Q, H, D]
    q5 = w.op("Reshape", q_pad, w.op("Concat", zero, zero, hkv, g, d, axis=0))  # [S, Q, Hkv, G, D]
    q4 = w.op("Transpose", q5, perm=[0, 2, 3, 1, 4])                            # [S, Hkv, G, Q, D]

    # K/V head-major [S, Hkv, L, D]: only transposes that move whole D-rows (fast), never
    # one that puts L innermost (ONNX Runtime's general transpose is ~5x slower)
    ctx_shape = w.op("Concat", zero, zero, neg1, d, axis=0)

    def head_major(cache, new):
        cached = w.op("Transpose", _gather_blocks(w, cache, ctx_block_ids, cast_cache), perm=[0, 3, 1, 2, 4])
        return w.op("Concat", w.op("Reshape", cached, ctx_shape),                # [S, Hkv, Lc, D]
                    w.op("Transpose", w.op("Gather", new, pad_index, axis=0), perm=[0, 2, 1, 3]), axis=2)

    keys, values = head_major(kc, k), head_major(vc, v)
    # scores as [S*Hkv, G*Q, L] = q @ k^T over 3-D views, so the k^T folds into the MatMul
    rows_of_d = w.const([0, -1])
    as_3d = lambda x: w.op("Reshape", w.op("Flatten", x, axis=2), w.op("Concat", rows_of_d, d, axis=0))  # noqa: E731
    scores3 = w.op("MatMul", w.op("Mul", as_3d(q4), scale), w.op("Transpose", as_3d(keys), perm=[0, 2, 1]))
    bias_shape = w.op("Shape", attn_bias)                                       # [S, 1, G*Q, L]
    scores_shape = w.op("Concat", w.op("Slice", bias_shape, zero, w.const([1])), hkv,
                        w.op("Slice", bias_shape, w.const([2]), w.const([4])), axis=0)
    scores = w.op("Reshape", scores3, scores_shape)                             # [S, Hkv, G*Q, L]
    probs = w.op("Softmax", w.op("Add", scores, attn_bias), axis=-1)
    o = w.op("MatMul", probs, values)                                           # [S, Hkv, G*Q, D]
    o5 = w.op("Reshape", o, w.op("Concat", zero, zero, g, neg1, d, axis=0))     # [S, Hkv, G, Q, D]
    o_pad = w.op("Reshape", w.op("Transpose", o5, perm=[0, 3, 1, 2, 4]),
                 w.op("Concat", neg1, h, d, axis=0))                            # [S*Q, H, D]
    w.op("Gather", o_pad, unpad_index, axis=0, outputs=[output])


def _write_decode_attention(w, q, k, v, kc, vc, ctx_block_ids: str, decode_bias: str, decode_split: str,
                            head_dim: str, scale: str, output: str, cast_cache: bool = False) -> None:
    """The decode path: every sequence computes one token (``T == S``), the common step.

    The gathered blocks stay in the pool's layout, ``[S, Lc * Hkv, D]`` (position-major,
    KV heads inside), and every query head scores against every (position, KV head) row;
    ``decode_bias`` (-inf off the head's own KV head and past the context) drops the others.
    That spends ``Hkv`` times the attention FLOPs (small at decode: one query row per head)
    to read the context once, with no transpose, no padding and no K/V concat: at batch 64
    the general path's gather, transpose and concat made three copies each of K and V per
    layer.
    The new token's K/V score and weigh as a separate ``[S, Hkv, D]`` term::

        scores = [q * scale @ K_ctx^T | q * scale @ k^T] + decode_bias    [S, H, (Lc + 1) * Hkv]
        out    = softmax(scores)[:, :, :Lc * Hkv] @ V_ctx + softmax(...)[:, :, Lc * Hkv:] @ v

    ``cast_cache``: float16 pools (the gathered blocks are cast to float32).
    """
    rows = w.op("Concat", w.const([0, -1]), head_dim, axis=0)
    k_ctx = w.op("Reshape", _gather_blocks(w, kc, ctx_block_ids, cast_cache), rows)  # [S, Lc*Hkv, D]
    v_ctx = w.op("Reshape", _gather_blocks(w, vc, ctx_block_ids, cast_cache), rows)
    q_scaled = w.op("Mul", q, scale)                                                # [S, H, D]
    transposed = lambda x: w.op("Transpose", x, perm=[0, 2, 1])  # noqa: E731  (folds into the MatMul)
    scores = w.op("Concat", w.op("MatMul", q_scaled, transposed(k_ctx)),
                  w.op("MatMul", q_scaled, transposed(k)), axis=2)                  # [S, H, (Lc+1)*Hkv]
    probs = w.op("Softmax", w.op("Add", scores, decode_bias), axis=-1)
    p_ctx, p_new = w.op("Split", probs, decode_split, axis=2, outputs=2)
    w.op("Add", w.op("MatMul", p_ctx, v_ctx), w.op("MatMul", p_new, v), outputs=[output])


def _write_ragged_decode_attention(w, q, k, v, kc, vc, metadata, heads: tuple[int, int, int],
                                   scale: str, output: str, cast_cache: bool = False) -> None:
    """The decode path over ragged context blocks: every sequence computes one token and the
    context lengths differ, so :func:`_write_decode_attention`'s padding to the longest
    context would gather (and score) mostly empty rows.

    Gathers only the NBt blocks the sequences use, ``[NBt, B * Hkv, D]`` in the pool's
    layout, and scores each against its sequence's query (all heads, all rows, masked by
    ``ragged_bias`` as in the padded decode path). The softmax spans blocks, so it is taken
    in pieces, as split-KV decoding does (Dao et al., "Flash-Decoding for long-context
    inference", 2023): a per-sequence max over the block maxes (through ``ragged_pad_map``),
    exponentials and P @ V per block, and the per-sequence sums as ``ragged_seg @ x`` (a
    small dense matmul: ONNX Runtime's CPU ScatterND with a reduction races on 2 threads).
    The new token joins the sums as its own ``[S, H, Hkv]`` term::

        s_b = q_owner(b) * scale @ K_b^T + ragged_bias_b          [NBt, H, B * Hkv]
        m_s = max(max over blocks of s, max of the new token's scores)    [S, H]
        out_s = (sum_b exp(s_b - m_s) @ V_b + exp(s_new - m_s) @ v) / (sum of the same exps)

    ``cast_cache``: float16 pools (the gathered blocks are cast to float32).
    """
    block_ids, owner, pad_map, bias, seg = metadata
    num_heads, num_kv_heads, head_dim = heads
    i64 = lambda v: w.const(v)  # noqa: E731
    rows = i64([0, -1, head_dim])
    k_blocks = w.op("Reshape", _gather_blocks(w, kc, block_ids, cast_cache), rows)   # [NBt, B*Hkv, D]
    v_blocks = w.op("Reshape", _gather_blocks(w, vc, block_ids, cast_cache), rows)
    q_scaled = w.op("Mul", q, scale)                                                 # [S, H, D]
    transposed = lambda x: w.op("Transpose", x, perm=[0, 2, 1])  # noqa: E731  (folds into the MatMul)
    s_blocks = w.op("Add", w.op("MatMul", w.op("Gather", q_scaled, owner, axis=0), transposed(k_blocks)), bias)
    group = num_heads // num_kv_heads
    own_head = np.arange(num_heads)[:, None] // group == np.arange(num_kv_heads)[None, :]
    s_new = w.op("Add", w.op("MatMul", q_scaled, transposed(k)),
                 w.const(np.where(own_head, 0.0, -np.inf)[None], np.float32))      # [S, H, Hkv]
    last, middle = i64([2]), i64([1])
    block_max = w.op("ReduceMax", s_blocks, last, keepdims=0)                        # [NBt, H]
    no_block = w.const(np.full((1, num_heads), -np.inf), np.float32)
    padded_max = w.op("Gather", w.op("Concat", block_max, no_block, axis=0), pad_map, axis=0)   # [S, Mc, H]
    m = w.op("Max", w.op("ReduceMax", padded_max, middle, keepdims=0),
             w.op("ReduceMax", s_new, last, keepdims=0))                             # [S, H]
    e_blocks = w.op("Exp", w.op("Sub", s_blocks, w.op("Unsqueeze", w.op("Gather", m, owner, axis=0), last)))
    e_new = w.op("Exp", w.op("Sub", s_new, w.op("Unsqueeze", m, last)))               # [S, H, Hkv]
    o_blocks = w.op("Reshape", w.op("MatMul", e_blocks, v_blocks), i64([0, -1]))     # [NBt, H*D]
    o = w.op("Add", w.op("Reshape", w.op("MatMul", seg, o_blocks), i64([0, num_heads, head_dim])),
             w.op("MatMul", e_new, v))                                               # [S, H, D]
    total = w.op("Add", w.op("MatMul", seg, w.op("ReduceSum", e_blocks, last, keepdims=0)),
                 w.op("ReduceSum", e_new, last, keepdims=0))                         # [S, H]
    w.op("Div", o, w.op("Unsqueeze", total, last), outputs=[output])


def _write_one_sequence_attention(w, q, k, v, kc, vc, ctx, ctx_block_ids: str, heads: tuple[int, int, int],
                                  output: str, cast_cache: bool = False) -> None:
    """Steps of one sequence computing ``Q > 1`` tokens: a prompt or prompt chunk alone (the
    TTFT-critical case), one draft verification. (ONNX Runtime's CPU GroupQueryAttention
    takes past context only at batch 1 when ``Q > 1``.)

    Runs ONNX Runtime's ``com.microsoft.GroupQueryAttention`` over the gathered context: its
    CPU kernel applies the causal mask itself and keeps scores per head, where the general
    body adds a ``[.., Q, L]`` bias and softmaxes over separate full-size tensors (SmolLM2
    fp32, a 512-token chunk after 1,536 cached tokens: 779 -> 606 ms per step). GQA's semantics (a
    "subsequent prompt" over a dynamic cache): past ``[S, Hkv, Lc, D]`` (S = 1) with the first
    ``seqlens_k[s] + 1 - Q = ctx_s`` rows valid, ``total_sequence_length = Lc + Q``.
    ``cast_cache``: float16 pools (the gathered past is cast to float32, GQA's type here).
    """
    from onnx import AttributeProto, TensorProto

    from .onnx_graph import MS_DOMAIN

    num_heads, num_kv_heads, head_dim = heads
    i64 = lambda v: w.const(v)  # noqa: E731
    num_seqs, num_tokens = w.op("Shape", ctx), w.op("Shape", q, start=0, end=1)
    q_len = w.op("Div", num_tokens, num_seqs)                                        # [1] = Q
    int32 = TensorProto.INT32
    seqlens_k = w.op("Cast", w.op("Sub", w.op("Add", ctx, q_len), i64([1])), to=int32)  # [S]
    cached = w.op("Mul", w.op("Shape", ctx_block_ids, start=1, end=2), w.op("Shape", kc, start=1, end=2))
    total = w.op("Cast", w.op("Squeeze", w.op("Add", cached, q_len), i64([0])), to=int32)  # scalar

    def past(cache):   # [S, Hkv, Lc, D]
        gathered = _gather_blocks(w, cache, ctx_block_ids, cast_cache)               # [S, Mc, B, Hkv, D]
        return w.op("Reshape", w.op("Transpose", gathered, perm=[0, 3, 1, 2, 4]), i64([0, 0, -1, head_dim]))

    def rows(x, width):  # [T, heads, D] -> [S, Q, heads * D]
        return w.op("Reshape", x, w.op("Concat", num_seqs, i64([-1, width]), axis=0))

    out = w.op("GroupQueryAttention", rows(q, num_heads * head_dim), rows(k, num_kv_heads * head_dim),
               rows(v, num_kv_heads * head_dim), past(kc), past(vc), seqlens_k, total,
               domain=MS_DOMAIN, outputs=3, num_heads=num_heads, kv_num_heads=num_kv_heads)[0]
    w.nodes[-1].attribute.append(AttributeProto(name="scale", ref_attr_name="scale", type=AttributeProto.FLOAT))
    w.op("Reshape", out, i64([-1, num_heads, head_dim]), outputs=[output])


def _branch(writer, name: str, output: str):
    """An ``If`` branch graph from a writer's nodes (values of the enclosing scope are read
    by name)."""
    from onnx import TensorProto, helper

    return helper.make_graph(writer.nodes, name, [],
                             [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])


def _scale_constant(w) -> str:
    """A ``Constant`` node whose float value is the function's ``scale`` attribute."""
    from onnx import AttributeProto

    scale = w.op("Constant", outputs=1)
    w.nodes[-1].attribute.append(AttributeProto(name="value_float", ref_attr_name="scale",
                                                type=AttributeProto.FLOAT))
    return scale


def make_decode_function(heads: tuple[int, int, int], opset: int | None = None,
                         kv_cache_dtype: str = "float32"):
    """The ``trtllm_lite::PagedDecodeAttention`` op as a model-local ONNX function: the
    PagedAttention op's decode step (every sequence computes one token, ``T == S``), which
    the ONNX Runtime graphs call from :func:`make_onnx_function`'s body.

    Inputs :data:`DECODE_INPUT_NAMES` (query ``[S, H, D]``, key / value ``[S, Hkv, D]``, the
    layer's pools, ``block_tables``, ``context_lens`` and the step's decode metadata from
    :func:`write_attention_metadata`), attribute ``scale``, output ``[S, H, D]`` float32.
    The body picks :func:`_write_decode_attention` (contexts padded to the longest) or
    :func:`_write_ragged_decode_attention` by ``use_padded_decode``. ``kv_cache_dtype``: the
    pools' type (:data:`KV_CACHE_DTYPES`; float16 blocks are cast to float32 once gathered).
    (Where the runtime's C++ kernels are registered, ONNX Runtime runs the PagedAttention
    kernel for the whole op and never reaches this function:
    ``trtllm_lite/ort_kernels/paged_attention.cc``.)
    """
    from onnx import helper

    from .onnx_graph import OPSET, NodeWriter

    num_heads, num_kv_heads, head_dim = heads
    cast = _cast_cache(kv_cache_dtype)
    w = NodeWriter("pd_")
    scale = _scale_constant(w)
    padded, ragged = NodeWriter("pd_pad_"), NodeWriter("pd_rag_")
    _write_decode_attention(padded, "query", "key", "value", "key_cache", "value_cache", "ctx_block_ids",
                            "decode_bias", "decode_split", w.const([head_dim]), scale, "pd_pad_output", cast)
    _write_ragged_decode_attention(ragged, "query", "key", "value", "key_cache", "value_cache", RAGGED_NAMES,
                                   heads, scale, "pd_rag_output", cast)
    w.op("If", "use_padded_decode", outputs=["output"],
         then_branch=_branch(padded, "padded_decode", "pd_pad_output"),
         else_branch=_branch(ragged, "ragged_decode", "pd_rag_output"))
    return helper.make_function(DOMAIN, DECODE_OP_TYPE, list(DECODE_INPUT_NAMES), ["output"], w.nodes,
                                [helper.make_opsetid("", opset or OPSET)], attributes=["scale"])


def make_onnx_functions(opset: int | None = None, heads: tuple[int, int, int] | None = None,
                        decode_path: bool = False, kv_cache_dtype: str = "float32") -> list:
    """The model-local functions a graph with PagedAttention nodes carries:
    :func:`make_onnx_function` and, with ``decode_path``, :func:`make_decode_function`
    (both for pools of ``kv_cache_dtype``)."""
    functions = [make_onnx_function(opset, heads, decode_path, kv_cache_dtype)]
    if heads is not None and decode_path:
        functions.append(make_decode_function(heads, opset, kv_cache_dtype))
    return functions


def make_onnx_function(opset: int | None = None, heads: tuple[int, int, int] | None = None,
                       decode_path: bool = False, kv_cache_dtype: str = "float32"):
    """The op as a model-local ONNX function whose body uses standard ops only.

    ONNX Runtime (where trtllm-lite's C++ kernels are not registered: with them, it runs the
    PagedAttention kernel instead) and TensorRT-RTX inline this body. Layout inside (S sequences, Q the
    longest query length in the step, Lc the cached positions gathered, G = heads per KV head)::

        query [T, H, D] --gather by pad index--> [S, Q, H, D]       (packed -> padded)
        key_cache --gather block_tables[:, :ceil(max ctx / B)]--> [S, Lc, Hkv, D]
        keys = concat(cached [S, Lc], new [S, Q])                    along positions
        scores [S, Hkv, G*Q, Lc+Q] = q * scale @ keys^T + bias      (0 / -inf, causal + context)
        out = softmax(scores) @ values --gather by unpad index--> [T, H, D]

    The gathered context grows with the longest context in the step, never with the pool.

    Args:
        opset: default-domain opset of the body (default :data:`~builder.onnx_graph.OPSET`).
        heads: ``(num_heads, num_kv_heads, head_dim)`` known at export: the function then
            takes the metadata inputs 9-12 (:func:`write_attention_metadata`, written once in
            the graph) and its reshapes use constants, so a layer's attention is about 30
            ops. ``None``: the self-contained 9-input body (computes its own metadata and
            reads the sizes from the inputs' shapes).
        decode_path: with ``heads``, also take the decode metadata (inputs 13-22) and pick
            the kernel by the step's shape (``If`` nodes): when every sequence computes one
            token (``T == S``), the ``PagedDecodeAttention`` op (:func:`make_decode_function`;
            the graph must carry that function too: :func:`make_onnx_functions`);
            :func:`_write_one_sequence_attention`
            (ONNX Runtime's GroupQueryAttention; only when ``head_dim`` is a multiple of 8,
            which its CPU kernel requires) for one sequence computing several, the general
            body otherwise. For ONNX Runtime's float32 graphs (measured there).
        kv_cache_dtype: the pools' type, ``"float32"`` or ``"float16"`` (build's
            kv_cache_dtype): with float16 every branch casts the blocks it gathers to float32
            (one ``Cast`` after each pool ``Gather``) and computes in float32; float32 bodies
            have no Cast.
    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """
    from onnx import AttributeProto, TensorProto, helper

    from .onnx_graph import MS_DOMAIN, OPSET, NodeWriter

    cast = _cast_cache(kv_cache_dtype)
    w = NodeWriter("pa_")
    q, k, v, kc, vc, _slots, bt, ctx, qsl = INPUT_NAMES
    if cast:   # float16 pools: the step's own K/V attended as the pool will hold them (saturated)
        low, high = w.const(-FLOAT16_MAX, np.float32), w.const(FLOAT16_MAX, np.float32)
        k, v = (w.op("Cast", w.op("Cast", w.op("Clip", x, low, high), to=TensorProto.FLOAT16), to=TensorProto.FLOAT)
                for x in (k, v))
    if heads is None:
        inputs = list(INPUT_NAMES)
        kv_heads = w.op("Shape", k, start=1, end=2)
        dims = {"heads": w.op("Shape", q, start=1, end=2), "kv_heads": kv_heads,
                "head_dim": w.op("Shape", q, start=2)}
        dims["group"] = w.op("Div", dims["heads"], kv_heads)
        metadata = write_attention_metadata(w, bt, ctx, qsl, w.op("Shape", kc, start=1, end=2), dims["group"])
    else:
        inputs = list(INPUT_NAMES + METADATA_NAMES[:NUM_DECODE_METADATA if decode_path else 4])
        num_heads, num_kv_heads, head_dim = heads
        dims = {"heads": w.const([num_heads]), "kv_heads": w.const([num_kv_heads]),
                "group": w.const([num_heads // num_kv_heads]), "head_dim": w.const([head_dim])}
        metadata = METADATA_NAMES[:4]
    scale = _scale_constant(w)
    if heads is None or not decode_path:
        _write_attention(w, q, k, v, kc, vc, metadata, dims, scale, "output", cast)
    else:
        # the kernel, by the step's shape (conditions from the metadata): every sequence
        # computing one token -> the PagedDecodeAttention op (its own function); else one sequence computing
        # several tokens (S == 1; ONNX Runtime's GroupQueryAttention, whose CPU kernel needs
        # head_dim % 8 == 0), else the general body
        general, decode = NodeWriter("pa_gen_"), NodeWriter("pa_dcall_")
        _write_attention(general, q, k, v, kc, vc, metadata, dims, scale, "pa_gen_output", cast)
        decode_inputs = [{"key": k, "value": v}.get(name, name) for name in DECODE_INPUT_NAMES]
        decode.op(DECODE_OP_TYPE, *decode_inputs, domain=DOMAIN, outputs=["pa_dcall_output"])
        decode.nodes[-1].attribute.append(AttributeProto(name="scale", ref_attr_name="scale",
                                                         type=AttributeProto.FLOAT))
        prefill, prefill_out = general, "pa_gen_output"
        if heads[2] % GQA_HEAD_DIM_MULTIPLE == 0:
            one_seq, prefill, prefill_out = NodeWriter("pa_gqa_"), NodeWriter("pa_pre_"), "pa_pre_output"
            _write_one_sequence_attention(one_seq, q, k, v, kc, vc, ctx, "ctx_block_ids", heads, "pa_gqa_output",
                                          cast)
            prefill.op("If", "is_one_sequence", outputs=[prefill_out],
                       then_branch=_branch(one_seq, "one_sequence", "pa_gqa_output"),
                       else_branch=_branch(general, "general", "pa_gen_output"))
        w.op("If", "is_decode", outputs=["output"],
             then_branch=_branch(decode, "decode", "pa_dcall_output"),
             else_branch=_branch(prefill, "prefill", prefill_out))
    opsets = [helper.make_opsetid("", opset or OPSET)]
    if heads is not None and decode_path:
        opsets += [helper.make_opsetid(MS_DOMAIN, 1), helper.make_opsetid(DOMAIN, OP_VERSION)]
    return helper.make_function(DOMAIN, OP_TYPE, inputs, ["output"], w.nodes, opsets,
                                attributes=["num_heads", "num_kv_heads", "scale"])


def _keep_nodes_feeding_outputs(graph) -> None:
    """Drop the nodes of ``graph`` (``onnx.GraphProto``, in place) that feed no graph output."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):   # (nodes are in topological order)
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(node.input)
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)


def without_attention_metadata(model):
    """A copy of an ONNX Runtime graph (``make_onnx_functions(heads, decode_path=True)``'s
    form) whose PagedAttention nodes take the op's 9 inputs alone: the step's metadata inputs
    and every node that only fed them are gone, and the op's function is the self-contained
    body (:func:`make_onnx_function` with ``heads=None``, which computes its metadata itself).

    For ONNX Runtime with trtllm-lite's kernels registered (``trtllm_lite/ort_kernels``): the
    C++ PagedAttention kernel reads the block tables directly, so the ~130 metadata nodes
    (index and mask tensors for the function body) would run every step for nothing
    (measured on SmolLM2 int4 at batch 1: ~5% of a decode step). The body written here
    computes the metadata in each layer (once per layer instead of once per step); the build
    then makes the nodes store the K/V themselves (:func:`with_kv_write_in_op`), which only
    the kernels do. The body is written for the graph's pool type (its ``key_cache.0`` input: float32 or
    float16).

    Args:
        model: ``onnx.ModelProto``; left unchanged.
    Returns:
        the new ``onnx.ModelProto``.
    """
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            del node.input[len(INPUT_NAMES):]
    _keep_nodes_feeding_outputs(graph)
    opset = next(o.version for o in out.opset_import if o.domain == "")
    pool = next(i for i in graph.input if i.name == "key_cache.0")
    kv_cache_dtype = "float16" if pool.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 else "float32"
    functions = [f for f in out.functions if (f.domain, f.name) not in {(DOMAIN, OP_TYPE), (DOMAIN, DECODE_OP_TYPE)}]
    del out.functions[:]
    out.functions.extend(functions + [make_onnx_function(opset, kv_cache_dtype=kv_cache_dtype)])
    return out


KV_OUTPUTS = ("new_keys", "new_values")


def with_kv_write_in_op(model):
    """A copy of an ONNX Runtime graph whose PagedAttention nodes store the step's K/V in the
    pools themselves (attribute ``kv_write_in_op = 1``: the C++ kernel writes them at
    ``slot_mapping`` before attending, as vLLM's ``reshape_and_cache`` does): no ``new_keys``
    / ``new_values`` outputs, and no Concat / Reshape nodes gathering every layer's K/V for
    them, so the runtime stores nothing after the call.

    Only for sessions with trtllm-lite's kernels registered (``graph_variants.custom_kernels``):
    the op's ONNX function body cannot write its inputs, so without the kernels this graph
    would never fill the pools (the runtime then takes the plain graphs, which return the K/V).
    Measured on SmolLM2 int4 at batch 1 (Zen 5 VM): the runtime's store took ~65 us of a ~4 ms
    step, the gathering nodes more.

    Args:
        model: ``onnx.ModelProto`` with ``new_keys`` / ``new_values`` outputs; left unchanged.
    Returns:
        the new ``onnx.ModelProto``.
    Raises:
        ValueError: the graph has no ``new_keys`` / ``new_values`` outputs.
    """
    import onnx
    from onnx import helper

    if not set(KV_OUTPUTS) <= {o.name for o in model.graph.output}:
        raise ValueError("with_kv_write_in_op: the graph has no new_keys / new_values outputs")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    kept_outputs = [o for o in graph.output if o.name not in KV_OUTPUTS]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            node.attribute.append(helper.make_attribute("kv_write_in_op", 1))
    _keep_nodes_feeding_outputs(graph)
    for f in out.functions:   # the body ignores it, but declares it (the checker wants that)
        if (f.domain, f.name) == (DOMAIN, OP_TYPE) and "kv_write_in_op" not in f.attribute:
            f.attribute.append("kv_write_in_op")
    return out
