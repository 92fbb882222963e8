"""Checkpoint settings the loaders once dropped silently (QA): each is now followed or refused."""
import json
import os
import warnings

import numpy as np
import pytest
import torch


def test_gpt2_untied_lm_head_is_read(tmp_path):
    """GPT-2 with ``tie_word_embeddings=False``: the checkpoint's own lm_head, not the embedding."""
    import transformers

    from builder.build import BuildConfig, build_engine
    from trtllm_lite.engine_dir import load_engine_dir
    from trtllm_lite.runners.base import ScheduledSeq, StepBatch
    from trtllm_lite.runners.onnxruntime_runner import OnnxRuntimeRunner

    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    hf.save_pretrained(tmp_path / "hf")
    engine = build_engine(str(tmp_path / "hf"), str(tmp_path / "e"),
                          BuildConfig(max_seq_len=64, max_num_batched_tokens=64, max_num_seqs=4, block_size=8))
    runner = OnnxRuntimeRunner(load_engine_dir(engine, verify_checksums=False), 16)
    prompt = np.random.default_rng(1).integers(0, 256, 20).tolist()
    logits = runner.execute(StepBatch(prefill=[ScheduledSeq(prompt, list(range(4)), 0, 20, num_logits=20)]))
    with torch.no_grad():
        np.testing.assert_allclose(logits, hf(torch.tensor([prompt])).logits[0].numpy(), atol=1e-4, rtol=1e-4)
    del runner
    # GPT-2's default eos id 50256 lies outside this 256-token vocabulary: the build drops it,
    # and an engine that still lists it (built before) ignores it with a warning; min_tokens,
    # which forbids the eos ids, indexed past the logits with it and failed the whole step (QA)
    from trtllm_lite import LLM, SamplingParams

    manifest_path = os.path.join(engine, "engine.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    assert manifest["model"]["eos_token_ids"] == []
    manifest["model"]["eos_token_ids"] = [50256]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.warns(UserWarning, match=r"end-of-sequence ids \[50256\] are outside the vocabulary"):
        llm = LLM(engine, num_threads=1, verify_checksums=False)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, min_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "vocab_size": 256,
         "max_position_embeddings": 64}


def test_qwen2_layer_types_decide_the_sliding_window():
    """transformers 5 reads ``layer_types`` over ``max_window_layers``: sliding layers there cap the
    engine at the window even where ``max_window_layers`` names none."""
    from builder.loaders import config_from_hf

    qwen2 = dict(LLAMA, architectures=["Qwen2ForCausalLM"], sliding_window=8, use_sliding_window=True,
                 max_window_layers=28)
    with pytest.warns(UserWarning, match="sliding window of 8 tokens"):
        capped = config_from_hf(dict(qwen2, layer_types=["sliding_attention", "sliding_attention"]))
    assert capped.max_position_embeddings == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_hf(dict(qwen2, layer_types=["full_attention"] * 2)).max_position_embeddings == 64
        assert config_from_hf(qwen2).max_position_embeddings == 64
        assert config_from_hf(dict(qwen2, use_sliding_window=False,
                                   layer_types=["sliding_attention"] * 2)).max_position_embeddings == 64


def test_quantized_hf_checkpoints_are_refused(tmp_path):
    """An FP8 checkpoint's float8 codes were read as the weights (its scales dropped)."""
    from safetensors.torch import save_file

    from builder.loaders import config_from_hf, load_hf_dir
    from builder.model_config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="quantization_config .*'fp8'"):
        config_from_hf(dict(LLAMA, quantization_config={"quant_method": "fp8"}))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    save_file({"model.embed_tokens.weight": torch.zeros(256, 64).to(torch.float8_e4m3fn)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="'model.embed_tokens.weight' .* float8_e4m3fn"):
        load_hf_dir(str(tmp_path))


def _gguf(path, rope_freqs=None, scaling=None, rope_dims=None, token_ids=None):
    """A GGUF with only the metadata and tensors config_from_gguf reads."""
    from gguf import GGUFReader, GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_vocab_size(256)
    if scaling:
        w.add_rope_scaling_type(scaling[0])
        w.add_rope_scaling_factor(scaling[1])
    if rope_dims:
        w.add_rope_dimension_count(rope_dims)
    for key, value in (token_ids or {}).items():
        getattr(w, f"add_{key}_token_id")(value)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFReader(path)


def test_gguf_rope_scaling_is_followed_or_refused(tmp_path):
    """llama.cpp's ``rope_freqs.weight`` (Llama 3.1/3.2's llama3 scaling) and
    ``rope.scaling.type`` linear were ignored; other scaling types and partial rotary are refused."""
    import transformers
    from gguf import RopeScalingType
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from builder.export_onnx import rope_inv_freq
    from builder.loaders import config_from_gguf
    from builder.model_config import UnsupportedModelError

    hf_config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0})
    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    config = config_from_gguf(_gguf(str(tmp_path / "a.gguf"), rope_freqs=plain / llama3.double().numpy()))
    np.testing.assert_allclose(rope_inv_freq(config), llama3.double().numpy(), rtol=1e-6)
    config = config_from_gguf(_gguf(str(tmp_path / "b.gguf"), scaling=(RopeScalingType.LINEAR, 4.0)))
    np.testing.assert_allclose(rope_inv_freq(config), plain / 4, rtol=1e-12)
    with pytest.raises(UnsupportedModelError, match="rope.scaling.type 'yarn'"):
        config_from_gguf(_gguf(str(tmp_path / "c.gguf"), scaling=(RopeScalingType.YARN, 4.0)))
    with pytest.raises(UnsupportedModelError, match="rope.dimension_count 8"):
        config_from_gguf(_gguf(str(tmp_path / "d.gguf"), rope_dims=8))
    assert config_from_gguf(_gguf(str(tmp_path / "e.gguf"), rope_dims=16)).rope_scaling is None


def test_generation_config_eos_ids_are_the_engines_too(tmp_path):
    """``generation_config.json``'s eos ids stop the engine as they stop transformers' generate
    (Qwen2.5 and Llama 3 instruct list more there than config.json has)."""
    from safetensors.torch import save_file

    from builder.loaders import load_hf_dir

    config = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96, "vocab_size": 256,
              "max_position_embeddings": 64, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (256, 64), "model.norm.weight": (64,), "lm_head.weight": (256, 64),
              "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.post_attention_layernorm.weight": (64,),
              "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
              "model.layers.0.self_attn.v_proj.weight": (32, 64), "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.mlp.gate_proj.weight": (96, 64), "model.layers.0.mlp.up_proj.weight": (96, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 96)}
    save_file({k: torch.zeros(v) for k, v in shapes.items()}, str(tmp_path / "model.safetensors"))
    assert load_hf_dir(str(tmp_path)).config.eos_token_ids == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_hf_dir(str(tmp_path)).config.eos_token_ids == [2, 7, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_hf_dir(str(tmp_path)).config.eos_token_ids == [2, 5]


def _tiny_llama_dir(tmp_path, extra: dict[str, torch.Tensor], tie: bool = True):
    """A 1-layer Llama checkpoint of zeros (and ``extra`` tensors) in ``tmp_path``."""
    from safetensors.torch import save_file

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, num_hidden_layers=1, tie_word_embeddings=tie)))
    shapes = {"model.embed_tokens.weight": (256, 64), "model.norm.weight": (64,),
              "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.post_attention_layernorm.weight": (64,),
              "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
              "model.layers.0.self_attn.v_proj.weight": (32, 64), "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.mlp.gate_proj.weight": (96, 64), "model.layers.0.mlp.up_proj.weight": (96, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 96)}
    save_file({**{k: torch.zeros(v) for k, v in shapes.items()}, **extra}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_integer_buffers_in_a_checkpoint_are_skipped_not_refused(tmp_path):
    """Integer and bool tensors (attention-mask buffers some checkpoints carry) are not weights:
    the model loads; only float8 (codes without their scales) is refused."""
    from builder.loaders import load_hf_dir

    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    loaded = load_hf_dir(_tiny_llama_dir(tmp_path, {"model.layers.0.self_attn.bias": mask,
                                                    "model.layers.0.self_attn.masked_bias": torch.tensor(-1e4),
                                                    "model.step": torch.tensor(3, dtype=torch.int64)}))
    assert "layers.0.self_attn.bias" not in loaded.weights and loaded.config.num_layers == 1


def test_tied_config_with_a_different_lm_head_in_the_checkpoint_warns(tmp_path):
    """``tie_word_embeddings`` true while the checkpoint holds an lm_head unlike the embedding:
    transformers versions disagree on which to use; the engine ties them and says so."""
    from builder.loaders import load_hf_dir

    with pytest.warns(UserWarning, match="lm_head.weight differs from the embedding"):
        load_hf_dir(_tiny_llama_dir(tmp_path / "a", {"lm_head.weight": torch.ones(256, 64)}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_hf_dir(_tiny_llama_dir(tmp_path / "b", {"lm_head.weight": torch.zeros(256, 64)}))


def test_gguf_end_of_turn_ids_end_generation_as_in_llama_cpp(tmp_path):
    """Llama 3 instruct GGUFs mark ``<|eot_id|>`` (and ``<|eom_id|>``) apart from eos: llama.cpp
    stops at any of them, and so does the engine."""
    from builder.loaders import config_from_gguf

    config = config_from_gguf(_gguf(str(tmp_path / "a.gguf"), token_ids={"eos": 7, "eot": 9, "eom": 7}))
    assert config.eos_token_ids == [7, 9]
    assert config_from_gguf(_gguf(str(tmp_path / "b.gguf"))).eos_token_ids == []


def test_build_output_and_checkpoint_errors_name_the_option(tmp_path):
    """One clear error, naming the option, where the build once wrote into the checkpoint
    (``--output`` = ``--model``), failed on a bare OSError (an output it cannot create) or only
    said "no *.safetensors" of a directory holding a pickle checkpoint (never loaded) (QA)."""
    from builder.build import BuildConfig, build_engine
    from builder.model_config import UnsupportedModelError

    model = _tiny_llama_dir(tmp_path / "hf", {})
    options = BuildConfig(max_seq_len=64, max_num_batched_tokens=64, max_num_seqs=4, block_size=8)
    with pytest.raises(ValueError, match="--output .* is the --model directory"):
        build_engine(model, model, options)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="--output .*a-file/engine.*: cannot write the engine directory there"):
        build_engine(model, str(tmp_path / "a-file" / "engine"), options)
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(UnsupportedModelError, match=r"found pytorch_model.bin: pickle checkpoints are never loaded"):
        build_engine(str(tmp_path / "pickle"), str(tmp_path / "engine"), options)


def test_gguf_tokenizer_larger_than_the_vocabulary_warns(tmp_path):
    """A GGUF whose tokenizer lists more tokens than ``vocab_size`` (the embedding's rows): the
    build says so (QA: accepted without a word; such prompt ids are refused per request)."""
    from gguf import GGUFReader, GGUFWriter

    from builder.loaders import config_from_gguf

    path = str(tmp_path / "a.gguf")
    w = GGUFWriter(path, "llama")
    for add, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 64),
                       ("feed_forward_length", 96), ("head_count", 4), ("vocab_size", 256)):
        getattr(w, f"add_{add}")(value)
    w.add_token_list([f"t{i}" for i in range(300)])
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.warns(UserWarning, match="the tokenizer has 300 tokens but the model 256"):
        assert config_from_gguf(GGUFReader(path)).vocab_size == 256


def test_sentencepiece_logprob_tokens_keep_their_leading_space(tmp_path):
    """A logprob's ``decoded_token`` is the token's own text: a SentencePiece word with its
    leading space, which decoding it alone strips (QA: the HTTP server's tokens then did not
    join to the text). A tiny Llama over a SentencePiece-style tokenizer, steered to one word."""
    import transformers

    from builder.build import BuildConfig, build_engine
    from tests.test_detokenizer import sentencepiece_tokenizer
    from trtllm_lite import LLM, SamplingParams

    config = transformers.LlamaConfig(vocab_size=262, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=1, intermediate_size=96, max_position_embeddings=64,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    sentencepiece_tokenizer(tmp_path / "hf")
    engine = build_engine(str(tmp_path / "hf"), str(tmp_path / "e"),
                          BuildConfig(max_seq_len=64, max_num_batched_tokens=64, max_num_seqs=4, block_size=8))
    llm = LLM(engine, num_threads=1, verify_checksums=False)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, logprobs=1, logit_bias={260: 100.0},
                                                 ignore_eos=True))[0].outputs[0]
    assert out.token_ids == [260] * 3 and out.text == " world world world"
    assert "".join(step[t].decoded_token for step, t in zip(out.logprobs, out.token_ids)) == out.text


def test_gguf_tokenizer_that_cannot_be_converted_fails_first_naming_it(tmp_path):
    """A GGUF whose tokenizer transformers cannot convert (here "gpt2" without its token
    scores) is one error naming ``--model`` and ``tokenizer.ggml.model`` (any exception from
    the conversion: tokenizers raises bare Exceptions, once a traceback), and, the tokenizer
    being converted first, no graph or weights file is left in ``--output`` (QA: a half-written
    engine directory)."""
    from gguf import GGUFWriter

    from builder.build import BuildConfig, build_engine
    from builder.model_config import UnsupportedModelError

    path = str(tmp_path / "tiny.gguf")
    w = GGUFWriter(path, "llama")
    for add, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 64),
                       ("feed_forward_length", 96), ("head_count", 4), ("head_count_kv", 2), ("vocab_size", 259)):
        getattr(w, f"add_{add}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(256)])
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (259, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
              "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64), "blk.0.attn_v.weight": (32, 64),
              "blk.0.attn_output.weight": (64, 64), "blk.0.ffn_norm.weight": (64,),
              "blk.0.ffn_gate.weight": (96, 64), "blk.0.ffn_up.weight": (96, 64), "blk.0.ffn_down.weight": (64, 96)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "engine"
    with pytest.raises(UnsupportedModelError, match=r"--model .*tiny.gguf.*cannot convert its tokenizer "
                                                    r"\(tokenizer.ggml.model 'gpt2'\)"):
        build_engine(path, str(out), BuildConfig(max_seq_len=64, max_num_batched_tokens=64, max_num_seqs=4,
                                                 block_size=8))
    assert not [f for f in os.listdir(out) if f.endswith((".onnx", ".bin"))]
