"""The PagedAttention ONNX function body against the float64 numpy reference."""
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from builder.onnx_graph import OPSET, NodeWriter
from builder.paged_attention import (DOMAIN, INPUT_NAMES, METADATA_NAMES, OP_TYPE, make_onnx_functions,
                                     reference_paged_attention, write_attention_metadata,
                                     write_kv_reference)
from tests.conftest import profile_prefix


def single_op_session(num_heads, num_kv_heads, head_dim, metadata=False, decode_path=False,
                      session_options=None, pool_type=TensorProto.FLOAT, kv_write_in_op=None):
    """One PagedAttention node; ``metadata``: fed by the metadata nodes written once in the
    graph (the engines' form) instead of the self-contained body; ``decode_path``: with the
    ONNX Runtime engines' decode path (taken when every sequence has one new token);
    ``pool_type``: the KV pools' element type (``TensorProto.FLOAT`` or ``FLOAT16``), or a
    (key_cache, value_cache) pair of types; ``kv_write_in_op``: the node's attribute (the
    kernel stores the step's K/V in the pools), left out when None."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    key_type, value_type = pool_type if isinstance(pool_type, tuple) else (pool_type, pool_type)
    dims = {"query": (f32, ["T", num_heads, head_dim]), "key": (f32, ["T", num_kv_heads, head_dim]),
            "value": (f32, ["T", num_kv_heads, head_dim]),
            "key_cache": (key_type, ["N", "B", num_kv_heads, head_dim]),
            "value_cache": (value_type, ["N", "B", num_kv_heads, head_dim]),
            "slot_mapping": (i64, ["T"]), "block_tables": (i64, ["S", "M"]),
            "context_lens": (i64, ["S"]), "query_start_loc": (i64, ["S1"])}
    inputs = [helper.make_tensor_value_info(n, *dims[n]) for n in INPUT_NAMES]
    w = NodeWriter("meta_")
    node_inputs = list(INPUT_NAMES)
    if metadata:
        node_inputs += write_attention_metadata(w, "block_tables", "context_lens", "query_start_loc",
                                                w.op("Shape", "key_cache", start=1, end=2),
                                                w.const([num_heads // num_kv_heads]),
                                                (num_heads, num_kv_heads) if decode_path else None)
    extra = {} if kv_write_in_op is None else {"kv_write_in_op": kv_write_in_op}
    node = helper.make_node(OP_TYPE, node_inputs, ["output"], domain=DOMAIN,
                            num_heads=num_heads, num_kv_heads=num_kv_heads, scale=head_dim ** -0.5, **extra)
    graph = helper.make_graph(w.nodes + [node], "pa", inputs,
                              [helper.make_tensor_value_info("output", f32, ["T", num_heads, head_dim])])
    functions = make_onnx_functions(heads=(num_heads, num_kv_heads, head_dim) if metadata else None,
                                    decode_path=decode_path,
                                    kv_cache_dtype="float16" if key_type == TensorProto.FLOAT16 else "float32")
    if kv_write_in_op is not None:   # declared by the body, as builder.paged_attention.with_kv_write_in_op does
        for f in functions:
            if f.name == OP_TYPE:
                f.attribute.append("kv_write_in_op")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(DOMAIN, 1)], functions=functions)
    # (pools the body cannot type: the kernel's own type check is what a test of them checks)
    onnx.checker.check_model(model, full_check=key_type == value_type != TensorProto.DOUBLE)
    return ort.InferenceSession(model.SerializeToString(), session_options,
                                providers=["CPUExecutionProvider"])


def random_step(rng, context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size):
    """Random pools with the context already written, and a packed step of new tokens."""
    num_seqs = len(context_lens)
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(blocks_per_seq) + 3
    perm = rng.permutation(num_blocks)
    max_blocks = max(blocks_per_seq)
    block_tables = np.zeros((num_seqs, max_blocks), np.int64)
    at = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[at:at + n]
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = rng.standard_normal(shape).astype(np.float32)
    value_cache = rng.standard_normal(shape).astype(np.float32)
    num_tokens = sum(query_lens)
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    slots = []
    for s, (c, n) in enumerate(zip(context_lens, query_lens)):
        pos = np.arange(c, c + n)
        slots.append(block_tables[s, pos // block_size] * block_size + pos % block_size)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    return dict(query=q, key=k, value=v, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=np.concatenate(slots).astype(np.int64), block_tables=block_tables,
                context_lens=np.asarray(context_lens, np.int64), query_start_loc=qsl)


CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, context_lens, query_lens)
    (6, 2, 16, 4, [0, 0, 0], [5, 1, 9]),           # fresh prefills, GQA
    (4, 4, 8, 16, [3, 17, 40], [1, 1, 1]),          # decode, MHA
    (4, 1, 8, 16, [0, 33, 16, 5], [7, 1, 20, 2]),  # mixed chunked prefill, MQA
    (9, 3, 64, 16, [100, 0], [13, 31]),             # SmolLM2 head shape
    (9, 3, 64, 16, [100, 0, 16, 47], [1, 1, 1, 1]),  # SmolLM2 decode (one prompt of one token)
    (8, 2, 16, 8, [5], [1]),                         # batch-1 decode
    (9, 3, 64, 16, [0], [37]),                       # one fresh prompt
    (4, 2, 16, 8, [20], [13]),                       # one prompt chunk after cached context
    (4, 4, 8, 16, [5], [4]),                         # one draft verification, MHA
    (4, 1, 8, 4, [0, 9, 30], [3, 3, 3]),             # equal lengths, several sequences, MQA
    (4, 2, 12, 4, [7], [5]),                         # head_dim 12: GroupQueryAttention cannot, general body
    (4, 4, 20, 4, [9, 2], [1, 1]),                   # head_dim 20, decode
    (9, 3, 64, 16, [40, 41, 47], [1, 1, 1]),         # decode, equal block counts: padded decode
    (4, 2, 8, 4, [0, 0], [1, 1]),                    # decode of 1-token prompts: no cached block
    (6, 2, 16, 4, [1, 30, 4, 64, 13], [1] * 5),     # decode, ragged contexts: ragged decode
]


@pytest.mark.parametrize("pool", ["float32", "float16"])
@pytest.mark.parametrize("metadata,decode_path", [(False, False), (True, False), (True, True)],
                         ids=["self-contained", "metadata-inputs", "decode-path"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,ctx,qlens", CASES)
def test_function_body_matches_reference(heads, kv_heads, head_dim, block_size, ctx, qlens, metadata,
                                         decode_path, pool):
    """Every body against the reference; with ``decode_path`` the all-decode cases run a
    decode branch (ragged when padding to the longest context would waste a quarter of the
    blocks, else padded), the one-sequence ones GroupQueryAttention and the others the
    general body; float16 pools (``--kv-cache-dtype float16``) against the reference over the
    same float16 values."""
    rng = np.random.default_rng(0)
    step = random_step(rng, ctx, qlens, heads, kv_heads, head_dim, block_size)
    step["key_cache"], step["value_cache"] = step["key_cache"].astype(pool), step["value_cache"].astype(pool)
    sess = single_op_session(heads, kv_heads, head_dim, metadata, decode_path,
                             pool_type=TensorProto.FLOAT16 if pool == "float16" else TensorProto.FLOAT)
    (got,) = sess.run(None, step)
    want = reference_paged_attention(step["query"], step["key"], step["value"], step["key_cache"],
                                     step["value_cache"], step["block_tables"], step["context_lens"],
                                     step["query_start_loc"], head_dim ** -0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_write_then_attend_equals_attend_over_cache():
    """Writing a step's K/V then decoding over them equals prefill over the same tokens."""
    rng = np.random.default_rng(1)
    step = random_step(rng, [0], [10], 4, 2, 8, 4)
    out_prefill = reference_paged_attention(step["query"], step["key"], step["value"], step["key_cache"],
                                            step["value_cache"], step["block_tables"], step["context_lens"],
                                            step["query_start_loc"], 8 ** -0.5)
    write_kv_reference(step["key_cache"], step["value_cache"], step["key"][:9], step["value"][:9],
                       step["slot_mapping"][:9])
    last = reference_paged_attention(step["query"][9:], step["key"][9:], step["value"][9:],
                                     step["key_cache"], step["value_cache"], step["block_tables"],
                                     np.array([9]), np.array([0, 1]), 8 ** -0.5)
    np.testing.assert_allclose(last[0], out_prefill[9], rtol=1e-5, atol=1e-6)



DECODE_CASES = [c for c in CASES if set(c[5]) == {1}] + [
    # (num_heads, num_kv_heads, head_dim, block_size, context_lens, query_lens): the C++
    # kernel's decode loops: vector widths (head_dim 16, 32, 64, 128) and the portable loop (others)
    (8, 8, 32, 16, [50, 3], [1, 1]),
    (16, 2, 128, 16, [300, 17, 0], [1, 1, 1]),
    (8, 1, 64, 32, [1000], [1]),
    (12, 4, 12, 4, [23, 8, 1], [1, 1, 1]),
    # fewer sequences with 8+ blocks of context: chunks of the context over all KV heads,
    # merged (SmolLM2's heads; a short sequence beside a long one; a context that ends on a
    # chunk boundary; one just below the threshold)
    (9, 3, 64, 16, [700], [1]),
    (9, 3, 64, 16, [530, 5, 64], [1, 1, 1]),
    (9, 3, 64, 16, [256, 255], [1, 1]),
    (9, 3, 64, 16, [127], [1]),
    # one sequence: even chunks, as many as the cores or a multiple (an odd block count; a
    # context ending on a block boundary; two and three blocks; under 64 KiB of K/V: one thread)
    (9, 3, 64, 16, [143], [1]),
    (9, 3, 64, 16, [160], [1]),
    (9, 3, 64, 16, [48], [1]),
    (9, 3, 64, 16, [33], [1]),
    (9, 3, 64, 16, [40], [1]),
    # two sequences or more (unchunked): a work item per sequence (all KV heads), the next
    # block prefetched a share per query head (4-7 sequences, and 8 or more)
    (9, 3, 64, 16, [300, 5, 129, 64, 17], [1] * 5),
    (8, 2, 32, 16, [33, 250, 96, 0], [1] * 4),
    (9, 3, 64, 16, [200, 0, 17, 64, 3, 150, 90, 33, 1, 400, 16, 77], [1] * 12),
    (6, 2, 20, 4, [1, 30, 4, 64, 13, 0, 7, 22, 9], [1] * 9),
    # blocks longer than 16 rows: the score pass's 16-position tiles and their masked tail, the
    # value pass's odd row (per-sequence items; chunks)
    (8, 2, 32, 40, [81, 5, 40, 120, 7, 1, 39, 200], [1] * 8),
    (4, 2, 16, 17, [300], [1]),
    # 2 query heads per KV head at head_dim 64 (the AVX-512 loops that load each K/V row once
    # for a KV head's 2-4 query heads: 3 and 4 are above), per sequence and in chunks
    (8, 4, 64, 16, [150, 40, 7], [1, 1, 1]),
    (4, 2, 64, 16, [500], [1]),
]

PREFILL_CASES = [c for c in CASES if set(c[5]) != {1}] + [
    # steps where a sequence computes several tokens: query tiles (128 / group tokens; 96 /
    # group on AVX-512), key chunks of 64 (four 16-key segments; a block of 40 or 17 rows split
    # across them), the causal part over the step's own tokens, decodes in the same step
    (9, 3, 64, 16, [0], [300]),                    # a long fresh prompt: several tiles
    (9, 3, 64, 16, [130], [77]),                   # a prompt chunk after a cached context
    (16, 2, 128, 16, [50, 0], [40, 1]),            # head_dim 128, GQA 8, a decode beside it
    (8, 8, 32, 16, [0, 5], [33, 1]),               # MHA: one-row groups
    (4, 2, 12, 4, [7, 0], [5, 19]),                # head_dim 12: the portable loop
    (8, 2, 32, 40, [81, 5], [20, 45]),             # 40-row blocks
    (4, 4, 16, 17, [300, 0], [2, 50]),             # 17-row blocks
    (9, 3, 64, 16, [0, 300, 40, 1000], [64, 1, 1, 1]),   # one prompt and three decodes
    # decodes between prompt chunks and a draft verification, each sequence's token wherever
    # it lies in the step: ten decodes (the decode kernels' item per sequence), with a cached
    # context of zero, one and several blocks
    (9, 3, 64, 16, [20, 0, 33, 16, 0, 1, 47, 64, 5, 200, 90, 9, 130],
     [1, 12, 1, 1, 1, 1, 5, 1, 1, 1, 1, 1, 30]),
    (6, 2, 16, 4, [5, 0, 17], [1, 3, 1]),          # two decodes: the chunked decode path
    # the AVX-512 tiles (head_dim a multiple of 16): 33 rows (a 32-row and a padded 16-row
    # score tile; value tiles across 16-row groups), a cached context beside the causal part
    (9, 3, 64, 16, [70, 0], [11, 6]),
]


def kernel_session(kernel_library, heads, kv_heads, head_dim, metadata=True, profile=False,
                   pool_type=TensorProto.FLOAT):
    so = ort.SessionOptions()
    so.register_custom_ops_library(kernel_library)
    so.enable_profiling = profile
    so.profile_file_prefix = profile_prefix()
    return single_op_session(heads, kv_heads, head_dim, metadata, metadata, so, pool_type)


@pytest.mark.parametrize("metadata", [True, False], ids=["metadata-inputs", "nine-inputs"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,ctx,qlens", DECODE_CASES + PREFILL_CASES)
def test_kernel_matches_reference(kernel_library, heads, kv_heads, head_dim, block_size, ctx, qlens, metadata):
    """The C++ PagedAttention kernel (registered with the session) against the float64
    reference, with the engines' metadata inputs (which it ignores) or the op's 9 inputs alone
    (the graphs for sessions with the kernels), and it is what ran: ONNX Runtime's profile
    lists the node by its op, and no ``If`` (the function body's kernel choice)."""
    step = random_step(np.random.default_rng(3), ctx, qlens, heads, kv_heads, head_dim, block_size)
    sess = kernel_session(kernel_library, heads, kv_heads, head_dim, metadata, profile=True)
    (got,) = sess.run(None, step)
    path = sess.end_profiling()
    with open(path) as f:
        ops = {e["args"].get("op_name") for e in json.load(f) if e.get("cat") == "Node"}
    os.remove(path)
    assert "PagedAttention" in ops and "If" not in ops
    want = reference_paged_attention(step["query"], step["key"], step["value"], step["key_cache"],
                                     step["value_cache"], step["block_tables"], step["context_lens"],
                                     step["query_start_loc"], head_dim ** -0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool", [np.float32, np.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,ctx,qlens", [
    (9, 3, 64, 16, [40, 300], [1, 1]),       # decode: an item per sequence
    (9, 3, 64, 16, [700], [1]),             # decode: one sequence in chunks, merged
    (4, 2, 12, 4, [40, 9], [1, 1]),          # decode: the portable loop
    (9, 3, 64, 16, [40, 0], [1, 30]),        # a decode beside a prompt (tiles)
    (9, 3, 64, 16, [40], [5]),               # a prompt chunk after the cached context
])
def test_kernel_keeps_a_nan_in_the_cache(kernel_library, heads, kv_heads, head_dim, block_size, ctx, qlens, pool):
    """A NaN in one cached K row (a model that overflowed at an earlier step) reaches every
    output row that attends it, as float arithmetic's softmax gives (the float64 reference),
    and no other: the exponentials' clamp at -87 once took the NaN for -87 on the decode
    paths, a weight of ~0, and the output looked fine."""
    step = random_step(np.random.default_rng(5), ctx, qlens, heads, kv_heads, head_dim, block_size)
    step["key_cache"][step["block_tables"][0, 1], 3, 0, 5] = np.nan   # sequence 0, position block_size + 3, KV head 0
    step["key_cache"] = step["key_cache"].astype(pool)
    step["value_cache"] = step["value_cache"].astype(pool)
    pool_type = TensorProto.FLOAT if pool == np.float32 else TensorProto.FLOAT16
    sess = kernel_session(kernel_library, heads, kv_heads, head_dim, metadata=False, pool_type=pool_type)
    (got,) = sess.run(None, step)
    want = reference_paged_attention(step["query"], step["key"], step["value"], step["key_cache"],
                                     step["value_cache"], step["block_tables"], step["context_lens"],
                                     step["query_start_loc"], head_dim ** -0.5)
    assert np.isnan(want).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,ctx,qlens", DECODE_CASES + PREFILL_CASES)
def test_kernel_reads_float16_pools(kernel_library, heads, kv_heads, head_dim, block_size, ctx, qlens):
    """float16 KV pools (an engine built with ``--kv-cache-dtype float16``): every path (decode
    items, context chunks, tiles, mixed steps; vector and portable loops) converts each pooled
    value exactly, so the output matches the float64 reference over the same float16 values as
    closely as float32 pools do; the step's own new K/V are attended rounded to float16 (the
    reference rounds them too)."""
    step = random_step(np.random.default_rng(3), ctx, qlens, heads, kv_heads, head_dim, block_size)
    step["key_cache"] = step["key_cache"].astype(np.float16)
    step["value_cache"] = step["value_cache"].astype(np.float16)
    sess = kernel_session(kernel_library, heads, kv_heads, head_dim, metadata=False, pool_type=TensorProto.FLOAT16)
    (got,) = sess.run(None, step)
    want = reference_paged_attention(step["query"], step["key"], step["value"], step["key_cache"],
                                     step["value_cache"], step["block_tables"], step["context_lens"],
                                     step["query_start_loc"], head_dim ** -0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ctx,qlens", [
    ([20, 37, 100, 5, 60, 61, 62, 63, 9], [1] * 9),   # a work item per sequence
    ([300, 250], [1, 1]),                              # chunks of the context, merged
    ([20, 37, 100, 5, 60, 61, 62, 63, 9, 0], [1] * 9 + [5]),   # decodes beside a prompt
], ids=["decode", "decode-chunks", "mixed"])
def test_kernel_softmax_holds_when_the_largest_score_is_the_last(kernel_library, ctx, qlens):
    """Scores far past exp's float32 range (~400), the largest at a decode's own new token (the
    last position, past the row's last whole vector of 8 or 16): the kernel must subtract the
    true row max there, or exp overflows. Against the float64 reference."""
    heads, kv_heads, head_dim = 9, 3, 64
    step = random_step(np.random.default_rng(5), ctx, qlens, heads, kv_heads, head_dim, 16)
    group = heads // kv_heads
    for s, q_len in enumerate(qlens):
        if q_len != 1:
            continue
        t = int(step["query_start_loc"][s])
        for h in range(kv_heads):   # the group's query heads all point along the new key, scaled up
            step["query"][t, h * group:(h + 1) * group] = step["key"][t, h]
        step["key"][t] *= 50.0
    sess = kernel_session(kernel_library, heads, kv_heads, head_dim, metadata=False)
    (got,) = sess.run(None, step)
    want = reference_paged_attention(step["query"], step["key"], step["value"], step["key_cache"],
                                     step["value_cache"], step["block_tables"], step["context_lens"],
                                     step["query_start_loc"], head_dim ** -0.5)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qlens", [[1, 1], [1, 6]], ids=["decode", "prefill"])
@pytest.mark.parametrize("field,value,message", [
    ("block_tables", 10_000, "block_tables\\[0, 1\\] = 10000 outside the pool's"),
    ("block_tables", -1, "block_tables\\[0, 1\\] = -1 outside the pool's"),
    ("context_lens", 10_000, "context_lens\\[1\\] = 10000 outside"),
    ("value", None, "key / value shapes"),
    ("query_start_loc", "short", "query_start_loc runs from 0 to"),
    ("query_start_loc", "decreasing", "is below query_start_loc"),
    ("block_tables", "no sequences", "query_start_loc runs from 0 to 0, expected 0 to"),
])
def test_kernel_rejects_bad_inputs(kernel_library, field, value, message, qlens):
    """A block table entry outside the pool, a context longer than the table, mismatched
    shapes or query offsets that do not cover the step's tokens in order: an INVALID_ARGUMENT
    error naming the input, before the kernel reads anything, and the session goes on."""
    sess = kernel_session(kernel_library, 9, 3, 64, metadata=False)

    def feed():
        return random_step(np.random.default_rng(4), [40, 7], qlens, 9, 3, 64, 16)

    bad = feed()
    if value == "no sequences":   # tokens, but no sequence to own them
        bad["block_tables"], bad["context_lens"] = bad["block_tables"][:0], bad["context_lens"][:0]
        bad["query_start_loc"] = bad["query_start_loc"][:1]
    elif field == "block_tables":
        bad["block_tables"][0, 1] = value
    elif field == "context_lens":
        bad["context_lens"][1] = value
    elif field == "value":
        bad["value"] = bad["value"][:-1]
    elif value == "short":
        bad["query_start_loc"][-1] -= 1
    else:
        bad["query_start_loc"][1] = bad["query_start_loc"][2] + 1
    with pytest.raises(Exception, match=message):
        sess.run(None, bad)
    good = feed()
    (got,) = sess.run(None, good)
    want = reference_paged_attention(good["query"], good["key"], good["value"], good["key_cache"],
                                     good["value_cache"], good["block_tables"], good["context_lens"],
                                     good["query_start_loc"], 64 ** -0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qlens", [[1, 1, 1], [1, 9, 1]], ids=["decode", "mixed"])
def test_float16_pools_saturate_new_kv_past_float16s_range(op_library, qlens):
    """New K/V past float16's range (|x| > 65504) on float16 pools: attended saturated at
    +-65504, as the runtime stores them, never as inf (inf keys made NaN rows; QA 18): the
    kernel (every build) and the function body, finite and equal to the saturating reference."""
    heads, kv_heads, head_dim = 9, 3, 64
    step = random_step(np.random.default_rng(6), [40, 7, 20], qlens, heads, kv_heads, head_dim, 16)
    step["key_cache"], step["value_cache"] = step["key_cache"].astype(np.float16), step["value_cache"].astype(np.float16)
    step["key"][0, 0, :4] = [7.0e4, -1.0e5, 65519.0, 3.0e38]
    step["value"][-1, 1, :3] = [-7.0e4, 1.0e6, 65520.0]
    step["query"] *= 1e-4   # scores stay in exp's range (the point is the saturation)
    so = None
    if op_library is not None:
        so = ort.SessionOptions()
        so.register_custom_ops_library(op_library)
    sess = single_op_session(heads, kv_heads, head_dim, session_options=so, pool_type=TensorProto.FLOAT16)
    (got,) = sess.run(None, step)
    want = reference_paged_attention(step["query"], step["key"], step["value"], step["key_cache"],
                                     step["value_cache"], step["block_tables"], step["context_lens"],
                                     step["query_start_loc"], head_dim ** -0.5)
    assert np.isfinite(got).all() and np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * 65504)


@pytest.mark.parametrize("pool", [np.float32, np.float16])
@pytest.mark.parametrize("qlens", [[1, 1, 1], [1, 9, 1], [4, 6]], ids=["decode", "mixed", "prefill"])
def test_kernel_writes_the_steps_kv_into_the_pools(kernel_library, pool, qlens):
    """``kv_write_in_op = 1`` (the graphs for sessions with the kernels): the pools, bound by
    IOBinding over the caller's numpy arrays as the runtime binds them, hold key / value at
    slot_mapping after the call (float16 pools: rounded to nearest even, saturating at
    +-65504, as the runtime's store does), every other slot is untouched, and the output is
    the float64 reference's. A slot outside the pool: an error naming slot_mapping, with the
    pools unchanged."""
    heads, kv_heads, head_dim = 9, 3, 64
    sess = single_op_session(heads, kv_heads, head_dim, session_options=_with_library(kernel_library),
                             pool_type=TensorProto.FLOAT16 if pool == np.float16 else TensorProto.FLOAT,
                             kv_write_in_op=1)
    step = random_step(np.random.default_rng(8), [40, 7, 20][:len(qlens)], qlens, heads, kv_heads, head_dim, 16)
    step["key_cache"], step["value_cache"] = step["key_cache"].astype(pool), step["value_cache"].astype(pool)
    step["key"][0, 0, :2] = [7.0e4, -1.0e5]   # past float16's range
    before = {name: step[name].copy() for name in ("key_cache", "value_cache")}

    def run(feed):
        binding = sess.io_binding()
        for name, array in feed.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        binding.bind_output("output")
        sess.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    got = run(step)
    want = reference_paged_attention(step["query"], step["key"], step["value"], before["key_cache"],
                                     before["value_cache"], step["block_tables"], step["context_lens"],
                                     step["query_start_loc"], head_dim ** -0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (65504 if pool == np.float16 else 1))
    slots = step["slot_mapping"]
    for name, new in (("key_cache", step["key"]), ("value_cache", step["value"])):
        flat, old = step[name].reshape(-1, kv_heads, head_dim), before[name].reshape(-1, kv_heads, head_dim)
        stored = np.clip(new, -65504, 65504).astype(pool) if pool == np.float16 else new
        np.testing.assert_array_equal(flat[slots], stored)
        others = np.setdiff1d(np.arange(len(flat)), slots)
        np.testing.assert_array_equal(flat[others], old[others])
    bad = {k: (v.copy() if k not in ("key_cache", "value_cache") else v) for k, v in step.items()}
    bad["slot_mapping"][0] = len(step["key_cache"]) * 16
    kept = {name: step[name].copy() for name in ("key_cache", "value_cache")}
    with pytest.raises(Exception, match=r"slot_mapping\[0\] = \d+ outside the pool's"):
        run(bad)
    for name in kept:
        np.testing.assert_array_equal(step[name], kept[name])


def _with_library(library):
    so = ort.SessionOptions()
    so.register_custom_ops_library(library)
    return so


@pytest.mark.parametrize("qlens", [[1], [2]], ids=["decode", "prefill"])
def test_kernel_rejects_pools_of_empty_blocks(kernel_library, qlens):
    """Pools whose blocks hold no slots (dimension 1 is 0), with an empty context (the only one
    such pools could hold): an INVALID_ARGUMENT naming the pools, not a division by zero (it
    killed the process with SIGFPE: QA, session 32)."""
    sess = kernel_session(kernel_library, 4, 2, 16, metadata=False)
    step = random_step(np.random.default_rng(6), [0], qlens, 4, 2, 16, 4)
    step["key_cache"], step["value_cache"] = (np.zeros((4, 0, 2, 16), np.float32) for _ in range(2))
    with pytest.raises(Exception, match=r"key_cache / value_cache hold blocks of 0 slots"):
        sess.run(None, step)


@pytest.mark.parametrize("key_type,value_type", [(np.float16, np.float32), (np.float64, np.float64)],
                         ids=["mixed", "float64"])
def test_kernel_rejects_pools_of_other_types(kernel_library, key_type, value_type):
    """Pools must be both float32 or both float16: anything else is an INVALID_ARGUMENT naming
    key_cache / value_cache (the op's schema takes any type there), before anything is read."""
    proto = {np.float16: TensorProto.FLOAT16, np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE}
    so = ort.SessionOptions()
    so.register_custom_ops_library(kernel_library)
    sess = single_op_session(9, 3, 64, session_options=so, pool_type=(proto[key_type], proto[value_type]))
    step = random_step(np.random.default_rng(4), [40, 7], [1, 3], 9, 3, 64, 16)
    step["key_cache"], step["value_cache"] = step["key_cache"].astype(key_type), step["value_cache"].astype(value_type)
    with pytest.raises(Exception, match="key_cache / value_cache must both be float32 or both float16"):
        sess.run(None, step)


def test_kernels_fall_back_to_function_bodies_without_a_compiler(monkeypatch, tmp_path):
    """No C++ compiler: library_path() warns once and returns None (the graphs then run the
    ops' ONNX function bodies, tested above)."""
    import trtllm_lite.ort_kernels as kernels

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_result", {})
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert kernels.library_path() is None
    assert kernels.library_path() is None


def test_the_built_library_is_readable_by_everyone_and_a_broken_one_is_rebuilt(monkeypatch, tmp_path):
    """A cache shared between users (a pre-built image, say) must be loadable by all; a cached
    library that does not load (truncated by a full disk, say) is rebuilt, not handed to ONNX
    Runtime (which would fail every session). One test, one build, unoptimized (-O0: ~9 s
    against ~24 s at -O3 on a busy 2-core VM; what is checked is the cache, not the code): the cache
    starts with a truncated library where the build would put it."""
    import stat

    import trtllm_lite.ort_kernels as kernels

    cxx = kernels._compiler()
    if cxx is None or kernels.library_path() is None:
        pytest.skip("trtllm-lite's ONNX Runtime kernels do not build here")
    monkeypatch.setattr(kernels, "CXX_FLAGS", ("-O0",) + tuple(f for f in kernels.CXX_FLAGS if f != "-O3"))
    monkeypatch.setenv("TRTLLM_LITE_CACHE_DIR", str(tmp_path))
    good = kernels.cache_dir() / kernels._build_key(cxx) / kernels.LIBRARY_NAME
    good.parent.mkdir(parents=True)
    good.write_bytes(Path(kernels.library_path()).read_bytes()[:100])
    monkeypatch.setattr(kernels, "_result", {})
    path = kernels.library_path()
    assert path == str(good) and good.stat().st_size > 100
    assert stat.S_IMODE(good.stat().st_mode) & 0o555 == 0o555
    so = ort.SessionOptions()
    so.register_custom_ops_library(path)
