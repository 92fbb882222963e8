"""Tiny random-weight models of every supported architecture against HF transformers."""
import os

import numpy as np
import pytest
import torch

from trtllm_lite import LLM, SamplingParams
from trtllm_lite.engine_dir import load_engine_dir
from trtllm_lite.runners.base import ScheduledSeq, StepBatch
from trtllm_lite.runners.onnxruntime_runner import OnnxRuntimeRunner, OrtOptions

KINDS = ["llama-gqa", "llama-mqa", "llama-mha", "mistral", "qwen2-bias", "gpt2", "llama-hd12"]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def kernel_graphs_engine(engine_dir: str, tmp_path) -> str:
    """A copy of the engine whose manifest names its kernels' graphs (``*.kernels.onnx``, the
    PagedAttention nodes without metadata inputs, storing the K/V themselves) as its graphs."""
    import json
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    for kind, file in manifest["graph_variants"]["custom_kernels"].items():
        manifest["graphs"][kind]["file"] = file
    (copy / "engine.json").write_text(json.dumps(manifest))
    return str(copy)


def test_kernel_graphs_without_the_kernels_are_refused(tiny_model, tmp_path):
    """The kernels' graphs store the step's K/V in their PagedAttention nodes (the C++ kernel's
    ``kv_write_in_op``), which the op's ONNX function body cannot: a runner without the kernels
    refuses them with a clear error instead of attending empty pools (only a hand-edited
    manifest names them as the engine's graphs)."""
    import onnx

    _, engine_dir = tiny_model("llama-gqa")
    engine = load_engine_dir(kernel_graphs_engine(engine_dir, tmp_path), verify_checksums=False)
    for file in engine.manifest["graph_variants"]["custom_kernels"].values():
        graph = onnx.load(os.path.join(engine.path, file), load_external_data=False).graph
        assert [o.name for o in graph.output] == ["logits"]
        assert all(any(a.name == "kv_write_in_op" and a.i == 1 for a in n.attribute)
                   for n in graph.node if n.op_type == "PagedAttention")
    with pytest.raises(ValueError, match="store the step's K/V in their PagedAttention nodes"):
        OnnxRuntimeRunner(engine, 64, options=OrtOptions(custom_kernels=False))


@pytest.mark.parametrize("prepacking,custom_kernels,kernel_graphs",
                         [(True, True, True), (False, True, True), (True, False, False)],
                         ids=["one-session", "decode-graph", "function-bodies"])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_logits_match_hf(tiny_model, kind, prepacking, custom_kernels, kernel_graphs, tmp_path):
    """Both runner modes: one prepacked session (decode steps through the prefill graph)
    and two sessions sharing one weight copy (decode steps through the decode graph); the
    attention by trtllm-lite's C++ kernel (where it builds: then through the graphs without
    attention metadata, whose PagedAttention nodes store the K/V) or by the op's ONNX function
    body in the engine's graphs."""
    from trtllm_lite.ort_kernels import library_path

    hf, engine_dir = tiny_model(kind)
    if kernel_graphs and not custom_kernels:
        engine_dir = kernel_graphs_engine(engine_dir, tmp_path)
    engine = load_engine_dir(engine_dir, verify_checksums=False)
    runner = OnnxRuntimeRunner(engine, 64,
                               options=OrtOptions(enable_prepacking=prepacking, custom_kernels=custom_kernels))
    assert ("decode" in runner.sessions) is not prepacking
    with_kernels = custom_kernels and library_path() is not None
    assert all((".kernels." in f) is (kernel_graphs and (with_kernels or not custom_kernels))
               for f in runner.graph_files.values())
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (1, 7, 13)]
    tables = [[0, 1, 2, 3, 4, 5], [10, 9, 8, 7, 6, 11], [20, 31, 22, 23, 40, 41]]
    seqs = [ScheduledSeq(list(p), t, 0, len(p)) for p, t in zip(prompts, tables)]
    logits = runner.execute(StepBatch(prefill=seqs))
    for row, p in zip(logits, prompts):
        np.testing.assert_allclose(row, hf_logits(hf, p)[-1], atol=1e-4, rtol=1e-4)
    # three decode steps for all sequences together, one token each
    for _ in range(3):
        for s, row in zip(seqs, logits):
            s.token_ids.append(int(row.argmax()))
            s.start, s.num_new_tokens = len(s.token_ids) - 1, 1
        logits = runner.execute(StepBatch(decode=seqs))
        for row, s in zip(logits, seqs):
            np.testing.assert_allclose(row, hf_logits(hf, s.token_ids)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("custom_kernels", [True, False], ids=["kernels", "function-bodies"])
def test_a_step_of_decodes_and_prompts_is_one_call_with_the_kernels(tiny_model, custom_kernels):
    """Decodes and prompts of different lengths in one step: with trtllm-lite's kernels
    (attention without padding) one graph call, so the weights are read once; with the
    function bodies (which pad every sequence to the call's longest) the calls
    group_by_query_length makes. The logits match HF either way."""
    from trtllm_lite.ort_kernels import library_path

    if custom_kernels and library_path() is None:
        pytest.skip("trtllm-lite's kernels do not build here (no C++ compiler)")
    hf, engine_dir = tiny_model("llama-gqa")
    runner = OnnxRuntimeRunner(load_engine_dir(engine_dir, verify_checksums=False), 96,
                               options=OrtOptions(custom_kernels=custom_kernels))
    calls = []
    run = runner._run
    runner._run = lambda kind, inputs: calls.append(len(inputs.query_start_loc) - 1) or run(kind, inputs)
    rng = np.random.default_rng(4)
    decodes = [ScheduledSeq(rng.integers(0, 256, n).tolist(), list(range(8 * i, 8 * i + 8)), 0, n)
               for i, n in enumerate((3, 9))]
    runner.execute(StepBatch(prefill=decodes))   # their prompts, cached
    for s in decodes:
        s.token_ids.append(int(rng.integers(0, 256)))
        s.start, s.num_new_tokens = len(s.token_ids) - 1, 1
    prompts = [ScheduledSeq(rng.integers(0, 256, n).tolist(), list(range(16 + 40 * i, 56 + 40 * i)), 0, n)
               for i, n in enumerate((150, 20))]
    calls.clear()
    logits = runner.execute(StepBatch(decode=decodes, prefill=prompts))
    assert calls == ([4] if custom_kernels else [1, 3])
    for row, s in zip(logits, decodes + prompts):
        np.testing.assert_allclose(row, hf_logits(hf, s.token_ids)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prepacking", [True, False], ids=["one-session", "decode-graph"])
def test_decode_steps_through_kept_bindings_match_the_general_path_bit_for_bit(tiny_model, prepacking):
    """Decode-only calls run through inputs kept bound between steps (DecodeBinding): two
    runners on one engine, one of them without, take the same calls, and their logits are the
    same bits, while the call's sequences change in number, a block table outgrows the bound
    width, and a call with a prompt (the general path, which rebinds its own) comes between;
    the HF reference holds throughout."""
    from trtllm_lite.ort_kernels import library_path
    from trtllm_lite.runners.onnxruntime_runner import DecodeBinding

    if library_path() is None:
        pytest.skip("trtllm-lite's kernels do not build here (no C++ compiler)")
    hf, engine_dir = tiny_model("llama-gqa")    # block size 4
    engine = load_engine_dir(engine_dir, verify_checksums=False)
    runners = [OnnxRuntimeRunner(engine, 128, options=OrtOptions(enable_prepacking=prepacking)) for _ in range(2)]
    assert all(runners[0]._decode_bindings.values()) and runners[0]._decode_bindings
    runners[1]._decode_bindings = {}
    width = DecodeBinding.BLOCK_TABLE_WIDTH_STEP
    rng = np.random.default_rng(5)
    lengths = (5, 4 * width - 3, 30)   # the second outgrows the first bound width in its third step
    tables = [list(range(40 * i + 39, 40 * i - 1, -1)) for i in range(3)]   # 40 blocks each, descending

    def blocks(i, tokens):           # sequence i's table for its tokens (block size 4)
        return tables[i][:-(-tokens // 4)]

    seqs = [[ScheduledSeq(rng.integers(0, 256, n).tolist(), blocks(i, n), 0, n) for i, n in enumerate(lengths)]]
    seqs.append([ScheduledSeq(list(s.token_ids), list(s.block_table), 0, s.num_new_tokens) for s in seqs[0]])

    def step(pick, prefill=()):
        out = [r.execute(StepBatch(decode=[s[i] for i in pick], prefill=[s[i] for i in prefill]))
               for r, s in zip(runners, seqs)]
        assert np.array_equal(out[0], out[1])
        for k, i in enumerate(list(pick) + list(prefill)):
            np.testing.assert_allclose(out[0][k], hf_logits(hf, seqs[0][i].token_ids)[-1], atol=1e-4, rtol=1e-4)
            token = int(out[0][k].argmax())
            for s in seqs:
                s[i].token_ids.append(token)
                s[i].start, s[i].num_new_tokens = len(s[i].token_ids) - 1, 1
                s[i].block_table = blocks(i, len(s[i].token_ids))

    step((), prefill=(0, 1))
    for _ in range(4):
        step((0, 1))
    kind = "prefill" if prepacking else "decode"    # the graph decode steps run through
    assert runners[0]._decode_bindings[kind].inputs.block_tables.shape == (2, 2 * width)
    step((1,))                       # fewer sequences
    step((0, 1))
    step((0, 1), prefill=(2,))       # a prompt: the general path, which binds its own arrays
    step((0, 1))                     # the shape bound before it
    step((2, 0, 1))
    step((2, 1))

@pytest.mark.parametrize("kind", KINDS)
def test_greedy_ids_match_hf_generate(tiny_model, kind):
    hf, engine_dir = tiny_model(kind)
    llm = LLM(engine_dir, num_kv_blocks=64, verify_checksums=False)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 20, 41)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_lone_prompt_in_chunks_matches_hf(tiny_model, kind):
    """One sequence alone: its prompt chunks (the later ones after cached context) run the
    one-sequence attention kernel, its decode steps the decode path."""
    hf, engine_dir = tiny_model(kind)
    llm = LLM(engine_dir, num_kv_blocks=64, verify_checksums=False, max_num_batched_tokens=16)
    prompt = np.random.default_rng(3).integers(0, 256, 41).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_group_by_query_length_partitions_and_bounds_padding():
    """Every sequence lands in exactly one call, each call's padding stays within the
    bound, and decodes ride with a short draft verification but not with prompt chunks."""
    from trtllm_lite.runners.base import group_by_query_length

    def seq(ctx, q):
        return ScheduledSeq(list(range(ctx + q)), [0] * (-(-(ctx + q) // 16)), ctx, q)

    def padding(group, seqs):
        q = max(seqs[i].num_new_tokens for i in group)
        keys = max(seqs[i].start + seqs[i].num_new_tokens for i in group)
        return (len(group) * q - sum(seqs[i].num_new_tokens for i in group)) * keys

    rng = np.random.default_rng(0)
    seqs = [seq(int(c), int(q)) for c, q in zip(rng.integers(0, 700, 40), rng.choice([1, 1, 1, 5, 64, 128, 512], 40))]
    groups = group_by_query_length(seqs)
    assert sorted(i for g in groups for i in g) == list(range(len(seqs)))
    assert all(padding(g, seqs) <= 1 << 14 for g in groups if len(g) > 1)
    prompts = [seq(0, 128)] * 4 + [seq(200, 1)]
    assert len(group_by_query_length(prompts)) == 2
    verify = [seq(100, 5)] + [seq(100, 1)] * 3
    assert len(group_by_query_length(verify)) == 1


def test_arena_shrinks_only_after_calls_with_large_attention_scores(tiny_model):
    """OrtOptions.arena_shrinkage: a decode or short prompt keeps the arena's chunks for the
    next step; a call whose padded scores may pass ARENA_SHRINK_SCORE_BYTES gives them back;
    with the option off, no call does; nor with trtllm-lite's kernels, whose attention
    allocates no scores (the function bodies run here)."""
    from trtllm_lite.ort_kernels import library_path
    from trtllm_lite.runners.base import build_step_inputs
    from trtllm_lite.runners.onnxruntime_runner import ARENA_SHRINK_SCORE_BYTES

    _, engine_dir = tiny_model("llama-gqa")
    engine = load_engine_dir(engine_dir, verify_checksums=False)
    runner = OnnxRuntimeRunner(engine, 64, options=OrtOptions(arena_shrinkage=True, custom_kernels=False))
    bs, heads = runner.block_size, runner.num_heads

    def inputs(prompt_len, num_seqs=1):
        blocks = -(-prompt_len // bs)
        return build_step_inputs([ScheduledSeq([1] * prompt_len, list(range(blocks)), 0, prompt_len)
                                  for _ in range(num_seqs)], bs)

    small = inputs(8, 4)
    # the smallest prompt whose padded scores heads x Q x (blocks * B + Q) x 4 bytes pass the limit
    big_len = next(n for n in range(bs, 1 << 16, bs) if 4 * heads * n * (2 * n) > ARENA_SHRINK_SCORE_BYTES)
    assert runner._run_options_for(small) is runner._run_options
    assert runner._run_options_for(inputs(big_len - bs)) is runner._run_options
    assert runner._run_options_for(inputs(big_len)) is runner._shrink_options
    off = OnnxRuntimeRunner(engine, 64, options=OrtOptions(arena_shrinkage=False, custom_kernels=False))
    assert off._run_options_for(inputs(big_len)) is off._run_options
    if library_path() is not None:
        kernels = OnnxRuntimeRunner(engine, 64, options=OrtOptions(arena_shrinkage=True))
        assert kernels._run_options_for(inputs(big_len)) is kernels._run_options


def test_engines_as_short_as_two_tokens_build_and_generate(tmp_path):
    """The build's compile check fits its prompts to any max_seq_len >= 2 (it ran a 3-token
    prompt and 2 tokens, so engines under 5 tokens failed to build); 1 is refused by name."""
    from builder.build import BuildConfig, build_engine
    from tests.conftest import make_tiny_hf

    hf_dir = make_tiny_hf("llama-gqa", str(tmp_path / "hf"))
    for max_seq_len in (2, 4):
        engine = build_engine(hf_dir, str(tmp_path / f"engine{max_seq_len}"),
                              BuildConfig(max_seq_len=max_seq_len, max_num_batched_tokens=16, max_num_seqs=4))
        out = LLM(engine).generate([[1] * (max_seq_len - 1)], SamplingParams(max_tokens=1, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 1
    for bad in (1, 0, -3):   # one message for every value below the minimum
        with pytest.raises(ValueError, match="max-seq-len must be >= 2"):
            build_engine(hf_dir, str(tmp_path / "engine1"), BuildConfig(max_seq_len=bad))
    # the runtime's max_seq_len has the same floor: no request fits in 1 token
    with pytest.raises(ValueError, match=r"max_seq_len must be an integer in \[2, 4\]"):
        LLM(engine, max_seq_len=1)


def test_ort_options_from_the_environment():
    """``TRTLLM_LITE_ORT_*``: 0/false/no/off and 1/yes, a number for the threads; set but
    empty counts as unset (the default stays, e.g. the w8a8 probe decides)."""
    env = {"TRTLLM_LITE_ORT_W8A8_UINT8_WEIGHTS": "", "TRTLLM_LITE_ORT_THREADS": " ",
           "TRTLLM_LITE_ORT_SPINNING": "off", "TRTLLM_LITE_ORT_CUSTOM_KERNELS": "yes"}
    o = OrtOptions.from_env(env)
    assert o.w8a8_uint8_weights is None and o.intra_op_num_threads is None
    assert o.allow_spinning is False and o.custom_kernels is True
    o = OrtOptions.from_env({"TRTLLM_LITE_ORT_W8A8_UINT8_WEIGHTS": "0", "TRTLLM_LITE_ORT_THREADS": "3"},
                            allow_spinning=False)
    assert o.w8a8_uint8_weights is False and o.intra_op_num_threads == 3 and o.allow_spinning is False
    with pytest.raises(ValueError, match="TRTLLM_LITE_ORT_THREADS must be an integer, got 'abc'"):   # (QA: unnamed)
        OrtOptions.from_env({"TRTLLM_LITE_ORT_THREADS": "abc"})
    assert OrtOptions.from_env({"TRTLLM_LITE_ORT_FLOAT_LINEAR": "OFF"}).float_linear_kernels is False
    with pytest.raises(ValueError, match="TRTLLM_LITE_ORT_FLOAT_LINEAR must be 1/true/yes/on or "
                                         "0/false/no/off, got 'disable'"):   # (QA, session 42: read as on)
        OrtOptions.from_env({"TRTLLM_LITE_ORT_FLOAT_LINEAR": "disable"})
