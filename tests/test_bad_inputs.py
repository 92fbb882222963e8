"""Bad input gets a clear error naming the problem, and nothing is lost."""
import json
import os
import re
import shutil

import numpy as np
import pytest

from trtllm_lite import LLM, SamplingParams
from trtllm_lite.engine_dir import EngineError


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "prompt is empty"),
    ([], SamplingParams(), "prompt is empty"),
    ([1, 2, 49152], SamplingParams(), "outside the vocabulary"),
    ([-1], SamplingParams(), "outside the vocabulary"),
    ([5] * 1025, SamplingParams(max_tokens=1), "max_seq_len"),
    ([5] * 1000, SamplingParams(max_tokens=100), "max_seq_len"),
])
def test_bad_request_raises_and_engine_keeps_serving(smollm2_llm, prompt, params, match):
    engine = smollm2_llm.engine
    other = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match=match):
        smollm2_llm.generate([prompt], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert other not in engine.requests
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"), (dict(seed=2 ** 64), "seed"),
    # a truthy string must not read as True (ignore_eos="no" generated past the answer)
    (dict(ignore_eos="no"), "ignore_eos must be a bool"),
    (dict(include_stop_str_in_output="x"), "include_stop_str_in_output must be a bool"),
    (dict(skip_special_tokens=1), "skip_special_tokens must be a bool"),
    # a lone surrogate (JSON's "\\ud800") can never match the text; it was accepted (QA)
    (dict(stop="\ud800"), "^stop is not valid Unicode text"),
    (dict(stop=["ok", "a\udfff"]), "^stop is not valid Unicode text"),
    # int() / float() made token 1 of 1.7 and True, and took "5" (QA)
    (dict(logit_bias={1.7: 3}), "logit_bias must map integer token ids to numbers"),
    (dict(logit_bias={True: 3}), "logit_bias must map integer token ids to numbers"),
    (dict(logit_bias={1: "5"}), "logit_bias must map integer token ids to numbers"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_scalars_are_accepted_as_python_numbers():
    p = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), seed=np.int64(3),
                       stop_token_ids=[np.int32(2)], ignore_eos=np.bool_(True))
    assert (p.max_tokens, p.temperature, p.seed, p.stop_token_ids, p.ignore_eos) == (5, 0.5, 3, [2], True)
    assert all(type(v) is t for v, t in ((p.max_tokens, int), (p.temperature, float), (p.seed, int),
                                          (p.stop_token_ids[0], int), (p.ignore_eos, bool)))


def test_stop_token_ids_are_kept_once_each_and_errors_abridge_the_value(smollm2_llm):
    """Each stop token id is kept once, in order: the engine looks every generated token up in
    the list, and a million repeats of one id cost ~10 ms a token there (QA). A refused value
    is abridged in the message, not echoed whole. A repeated id still stops generation."""
    p = SamplingParams(stop_token_ids=[7, 3] * 500_000 + [9])
    assert p.stop_token_ids == [7, 3, 9]
    with pytest.raises(ValueError, match="stop_token_ids must be non-negative integers") as err:
        SamplingParams(stop_token_ids=[-1] * 1_000_000)
    assert len(str(err.value)) < 200
    prompt = [1, 2, 3, 4]
    free = smollm2_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    third = free[0].outputs[0].token_ids[2]
    out = smollm2_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                        stop_token_ids=[third] * 100_000))[0].outputs[0]
    assert out.token_ids == free[0].outputs[0].token_ids[:3] and out.finish_reason == "stop"
    assert out.stop_reason == third


@pytest.mark.parametrize("ids", [[1, True], [True, 1], [1, 1.0], [1.0, 1], [3, np.True_], [3, np.float64(3.0)],
                                 [7] * 100_000 + [7.0]])
def test_stop_token_ids_refuse_a_non_integer_equal_to_an_earlier_id(ids):
    """Keeping each id once must not skip checking the repeats: True and 1.0 equal 1, and
    [1, True] / [1, 1.0] were accepted (kept as [1]) while [True, 1] / [1.0] were refused (QA)."""
    with pytest.raises(ValueError, match="stop_token_ids must be non-negative integers"):
        SamplingParams(stop_token_ids=ids)
    assert SamplingParams(stop_token_ids=[np.int64(3), 3, 2]).stop_token_ids == [3, 2]


def test_abort_frees_blocks_at_every_stage(smollm2_llm):
    engine = smollm2_llm.engine
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    waiting = engine.add_request([7] * 40, params)
    assert engine.abort(waiting).outputs[0].finish_reason == "abort"   # waiting
    running = engine.add_request([7] * 40, params)
    engine.step()
    engine.step()
    assert engine.kv.pool.num_used > 0
    engine.abort(running)                                               # decoding
    assert engine.abort(running) is None                                # idempotent
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def copy_engine(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_engine_path_that_is_a_file(tmp_path):
    f = tmp_path / "engine.txt"
    f.write_text("not an engine")
    with pytest.raises(EngineError, match="is a file, not a directory"):
        LLM(str(f))


def test_missing_engine_dir(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(EngineError, match="engine.json is missing"):
        LLM(str(tmp_path))


def test_other_format_version(smollm2_engine, tmp_path):
    d = copy_engine(smollm2_engine, str(tmp_path / "e"))
    manifest = json.load(open(os.path.join(d, "engine.json")))
    manifest["format_version"] = 999
    json.dump(manifest, open(os.path.join(d, "engine.json"), "w"))
    with pytest.raises(EngineError, match="format_version 999"):
        LLM(d)


@pytest.mark.parametrize("edit, message", [
    (lambda m: [m], "is not a JSON object"),
    (lambda m: {k: v for k, v in m.items() if k != "build"}, "'build' is missing"),
    (lambda m: {**m, "build": {**m["build"], "block_size": 0}}, "build.block_size must be a positive integer"),
    (lambda m: {**m, "model": {**m["model"], "vocab_size": "300"}}, "model.vocab_size must be a positive"),
    (lambda m: {**m, "build": {**m["build"], "max_seq_len": -5}}, "build.max_seq_len must be a positive"),
    (lambda m: b"\xff\xfe not json", "is not valid JSON"),
])
def test_malformed_manifest_is_refused_naming_the_field(smollm2_engine, tmp_path, edit, message):
    """A hand-edited engine.json fails at load with the field named (QA 25: KeyError,
    ZeroDivisionError and TypeError tracebacks from deep in the runtime)."""
    manifest = edit(json.load(open(os.path.join(smollm2_engine, "engine.json"))))
    path = tmp_path / "engine.json"
    path.write_bytes(manifest) if isinstance(manifest, bytes) else path.write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match=message):
        LLM(str(tmp_path))


def test_checksum_mismatch_names_the_file(smollm2_engine, tmp_path):
    d = copy_engine(smollm2_engine, str(tmp_path / "e"))
    with open(os.path.join(d, "decode.onnx"), "ab") as f:
        f.write(b"\0")
    with pytest.raises(EngineError, match="'decode.onnx'.*sha256"):
        LLM(d)


def test_unknown_model_is_a_clear_error(tmp_path):
    from builder.build import build_engine

    with pytest.raises(FileNotFoundError, match="--model 'no-such-model': no such file or directory"):
        build_engine("no-such-model", str(tmp_path / "e"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is a directory without config.json"):
        build_engine(str(tmp_path / "empty"), str(tmp_path / "e"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match="is a file but not a .gguf file"):
        build_engine(str(tmp_path / "weights.bin"), str(tmp_path / "e"))


def test_unreadable_model_files_name_model_and_path(tmp_path, capsys):
    """A file or config.json that exists but is not a checkpoint: a ValueError naming --model,
    the path and the reader's error, not a traceback (QA 19); nothing is written."""
    import importlib.util

    from builder.build import build_engine
    from trtllm_lite.cli import main

    garbage = tmp_path / "model.GGUF"     # (the extension in any case)
    garbage.write_bytes(b"GGUF" + bytes(range(104)))
    (tmp_path / "empty.gguf").write_bytes(b"")
    bad_config = tmp_path / "hf"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("[1, 2]")
    for model, kind in ((garbage, "a GGUF file"), (tmp_path / "empty.gguf", "a GGUF file"),
                        (bad_config, "a Hugging Face checkpoint")):
        with pytest.raises(ValueError, match=f"--model '{re.escape(str(model))}': cannot read .* as {kind}"):
            build_engine(str(model), str(tmp_path / "e"))
        assert not (tmp_path / "e").exists()
    (bad_config / "config.json").write_text("{}")   # (no architecture: the loader's own error)
    with pytest.raises(ValueError, match=f"--model '{re.escape(str(bad_config))}': unsupported architecture"):
        build_engine(str(bad_config), str(tmp_path / "e"))
    if importlib.util.find_spec("tensorrt") is None:   # TensorRT absent: one line, no traceback
        assert main(["build", "--model", str(garbage), "--output", str(tmp_path / "e"),
                     "--backend", "tensorrt", "--dtype", "float16", "--kv-cache-dtype", "float16"]) == 1
        assert "'tensorrt', which is not installed" in capsys.readouterr().err


def test_unsupported_architecture_and_missing_tensor(tmp_path):
    from builder.loaders import load_hf_dir
    from builder.model_config import UnsupportedModelError
    from tests.conftest import make_tiny_hf

    d = make_tiny_hf("llama-gqa", str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump(dict(cfg, architectures=["FalconForCausalLM"]), open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM"):
        load_hf_dir(d)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(d, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="layers.1.mlp.up_proj.weight"):
        load_hf_dir(d)


def test_a_weight_of_the_wrong_shape_is_named(tmp_path):
    """QA 25: a q_proj cut short failed the build's compile check with a traceback about
    RotarySplitQKV's heads; the loader names the weight and the config's shape."""
    from safetensors.torch import load_file, save_file

    from builder.loaders import load_model
    from builder.model_config import UnsupportedModelError
    from tests.conftest import make_tiny_hf

    d = make_tiny_hf("llama-gqa", str(tmp_path / "m"))
    tensors = load_file(os.path.join(d, "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:32].clone()
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.qkv\.weight has shape \[96, 64\], but the "
                                                    r"config makes it \[128, 64\]"):
        load_model(d)
    tensors[name] = tensors[name].T[:, :32].contiguous()   # [64, 32]: q's second dimension differs from k's and v's
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.self_attn\.q_proj\.weight \[64, 32\], "
                                                    r"layers\.0\.self_attn\.k_proj\.weight \[32, 64\]"):
        load_model(d)


def test_model_settings_the_graphs_lack_are_refused_or_capped():
    """QA 25: these were ignored, and the engine disagreed with HF (SiLU for GELU, no
    per-layer attention scale, full attention for a sliding window)."""
    import warnings

    from builder.loaders import config_from_hf
    from builder.model_config import UnsupportedModelError

    llama = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "vocab_size": 256,
             "max_position_embeddings": 64}
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        config_from_hf(dict(llama, hidden_act="gelu"))
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256,
            "n_positions": 64}
    with pytest.raises(UnsupportedModelError, match="scale_attn_by_inverse_layer_idx"):
        config_from_hf(dict(gpt2, scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(UnsupportedModelError, match="scale_attn_weights"):
        config_from_hf(dict(gpt2, scale_attn_weights=False))
    with pytest.warns(UserWarning, match="sliding window of 8 tokens"):
        capped = config_from_hf(dict(llama, architectures=["MistralForCausalLM"], sliding_window=8))
    assert capped.max_position_embeddings == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # Qwen2 names a window it does not use; Mistral's may be null
        assert config_from_hf(dict(llama, architectures=["Qwen2ForCausalLM"], sliding_window=8,
                                   use_sliding_window=False)).max_position_embeddings == 64
        assert config_from_hf(dict(llama, architectures=["MistralForCausalLM"],
                                   sliding_window=None)).max_position_embeddings == 64
        # Qwen2 slides only in layers from max_window_layers on: none of 2 layers here
        assert config_from_hf(dict(llama, architectures=["Qwen2ForCausalLM"], sliding_window=8,
                                   use_sliding_window=True, max_window_layers=2)).max_position_embeddings == 64


def test_a_build_stopped_part_way_over_an_engine_leaves_no_manifest(tiny_model, tmp_path, monkeypatch):
    """Rebuilding into an engine's directory and stopping part way (here: the export fails)
    leaves the directory without engine.json, so loading it says it is unfinished instead of
    reading the old manifest beside half-written files."""
    import builder.build as build_module
    from trtllm_lite.engine_dir import load_engine_dir

    _, engine = tiny_model("llama-gqa")
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    load_engine_dir(str(copy), verify_checksums=True)       # a whole engine first

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "export_graphs", stopped)
    source = load_engine_dir(str(copy), verify_checksums=False).manifest["source"]["path"]
    with pytest.raises(KeyboardInterrupt):
        build_module.build_engine(source, str(copy), build_module.BuildConfig(max_seq_len=256, block_size=4))
    with pytest.raises(EngineError, match="engine.json is missing"):
        load_engine_dir(str(copy))


@pytest.mark.parametrize("prompts", [42, None, 3.5])
def test_prompts_of_the_wrong_type_are_a_type_error(smollm2_llm, prompts):
    with pytest.raises(TypeError, match="prompts"):
        smollm2_llm.generate(prompts, SamplingParams(max_tokens=1))


@pytest.mark.parametrize("prompt,error,match", [
    ({"a": 1}, ValueError, "exactly one of 'prompt' or 'prompt_token_ids'"),
    ({}, ValueError, "exactly one of"),
    ({"prompt": "Hi", "prompt_token_ids": [1, 2]}, ValueError, "exactly one of"),
    ([{"prompt": "Hi"}, {"text": "Hi"}], ValueError, "exactly one of"),
    ({1: "a", "prompt": "x"}, ValueError, "exactly one of"),
    ({"prompt": [1, 2]}, TypeError, "'prompt' must be a str"),
    ({"prompt_token_ids": "The capital"}, TypeError, "'prompt_token_ids' must be a list of token ids"),
    ({"prompt_token_ids": 5}, TypeError, "'prompt_token_ids' must be a list of token ids, got int"),
])
def test_dict_prompts_take_exactly_prompt_or_prompt_token_ids(smollm2_llm, prompt, error, match):
    """vLLM's TextPrompt / TokensPrompt forms; anything else names the keys or the type, and
    nothing runs (the engine's make_request, which AsyncLLM shares, does the check)."""
    with pytest.raises(error, match=match):
        smollm2_llm.generate(prompt, SamplingParams(max_tokens=1))
    with pytest.raises(error, match=match):
        smollm2_llm.engine.make_request(prompt if isinstance(prompt, dict) else prompt[1])
    assert smollm2_llm.engine.kv.pool.num_free == smollm2_llm.engine.kv.pool.num_blocks


def test_dict_prompts_generate_what_plain_prompts_do(smollm2_llm):
    """``{"prompt": str}`` and ``{"prompt_token_ids": ids}`` (vLLM's forms), alone or mixed in
    a list with plain prompts, give the same greedy tokens as the plain forms."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    text = "The capital of France is"
    ids = smollm2_llm.tokenizer.encode(text)
    plain = smollm2_llm.generate([text, ids], params)
    single = smollm2_llm.generate({"prompt_token_ids": ids}, params)
    mixed = smollm2_llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, text], params)
    numpy_ids = smollm2_llm.generate(list(np.asarray(ids, np.int64)), params)
    array_ids = smollm2_llm.generate(np.asarray(ids), params)
    want = [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in single] == want[1:]
    assert [o.outputs[0].token_ids for o in mixed] == want + want[:1]
    assert [o.outputs[0].token_ids for o in numpy_ids] == want[1:]   # numpy ints as ids
    assert [o.outputs[0].token_ids for o in array_ids] == want[1:]   # a 1-D array of ids
    assert mixed[0].prompt == text


def test_serve_cli_rejects_a_bad_port_and_reports_a_busy_one(smollm2_engine):
    import socket
    import subprocess
    import sys

    run = lambda *a: subprocess.run([sys.executable, "-m", "trtllm_lite.cli", "serve", "--engine", smollm2_engine,  # noqa: E731
                                     "--no-verify-checksums", "--num-kv-blocks", "16", *a],
                                    capture_output=True, text=True, timeout=120)
    bad = run("--port", "70000")
    assert bad.returncode == 2 and "out of range 0-65535" in bad.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = run("--port", "0", "--http-port", str(busy.getsockname()[1]))
    assert taken.returncode == 1 and "error:" in taken.stderr and "Traceback" not in taken.stderr


def test_serve_cli_rejects_a_token_budget_below_max_num_seqs(smollm2_engine):
    """``trtllm-lite serve`` exits 1 with one line naming both limits, not a traceback
    (it used to start serving with the budget silently below max_num_seqs)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "trtllm_lite.cli", "serve", "--engine", smollm2_engine,
                           "--no-verify-checksums", "--num-kv-blocks", "16", "--port", "0",
                           "--max-num-seqs", "8", "--max-num-batched-tokens", "4"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "error: max_num_batched_tokens (4) must be greater than or equal to max_num_seqs (8)" in done.stderr


@pytest.mark.parametrize("flag, value, message, code", [
    ("--shutdown-grace", "-1", "argument --shutdown-grace: must be a finite number >= 0, got -1", 2),
    ("--shutdown-grace", "nan", "argument --shutdown-grace: must be a finite number >= 0, got nan", 2),
    ("--shutdown-grace", "inf", "argument --shutdown-grace: must be a finite number >= 0, got inf", 2),
    ("--request-timeout", "0", "argument --request-timeout: must be a finite number > 0, got 0", 2),
])
def test_serve_cli_refuses_a_grace_or_timeout_out_of_range(smollm2_engine, flag, value, message, code):
    """QA, session 34: ``--shutdown-grace -1`` was taken (and acted as 0 at SIGTERM); such
    values are refused with one line naming the parameter, before the engine loads."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "trtllm_lite.cli", "serve", "--engine", smollm2_engine,
                           "--no-verify-checksums", "--num-kv-blocks", "16", "--port", "0", flag, value],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code and "Traceback" not in done.stderr
    assert f"trtllm-lite serve: error: {message}" in done.stderr


def test_generate_cli_refuses_a_system_message_without_chat(smollm2_engine, capsys):
    """QA, session 34: ``generate --system`` without ``--chat`` was silently dropped (the
    answer was the plain prompt's); it is refused, naming both flags."""
    from trtllm_lite.cli import main

    assert main(["generate", "--engine", smollm2_engine, "--prompt", "hi", "--system", "Answer in French"]) == 1
    assert "trtllm-lite generate: error: --system is a chat message: it needs --chat" in capsys.readouterr().err


def test_client_cli_refuses_a_system_message_without_chat(capsys):
    """QA, session 35: ``client --system`` without ``--chat`` was silently dropped, as
    ``generate``'s was; refused before any connection is made."""
    from trtllm_lite.cli import main

    assert main(["client", "--prompt", "hi", "--system", "Answer in French", "--server", "127.0.0.1:9"]) == 1
    assert "--system is a chat message: it needs --chat" in capsys.readouterr().err


@pytest.mark.parametrize("salt, error", [(3, TypeError), ("", ValueError), ("a\udc00", ValueError)])
def test_bad_cache_salt_names_it(smollm2_llm, salt, error):
    with pytest.raises(error, match="cache_salt"):
        smollm2_llm.generate("Hi", SamplingParams(max_tokens=1), cache_salt=salt)
    with pytest.raises(error, match="cache_salt"):
        smollm2_llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), cache_salt=salt)


def test_request_id_that_is_not_unicode_is_refused_and_nothing_is_queued(smollm2_llm):
    engine = smollm2_llm.engine
    with pytest.raises(ValueError, match="request_id is not valid Unicode"):
        engine.add_request("Hi", SamplingParams(max_tokens=1), request_id="r\udc00")
    assert not engine.has_unfinished_requests()


def test_bad_words_longer_than_max_seq_len_tokens_can_cover_are_refused_untokenized(smollm2_llm):
    """Bad words are tokenized where the request is made (a server's event loop): more
    characters in all than max_seq_len tokens can cover are refused before tokenizing, as a
    prompt is (2 MB of bad words held the loop ~5 s, every stream and health check with it)."""
    engine = smollm2_llm.engine
    limit = engine.scheduler_config.max_seq_len * engine.tokenizer.max_chars_per_token
    words = ["x" * (limit // 2), "y" * (limit // 2 + 1)]   # each fits alone; together they do not
    with pytest.raises(ValueError, match=r"^bad_words has \d+ characters in all"):
        engine.make_request("Hi", SamplingParams(max_tokens=2, bad_words=words))
    many = ["a"] * (engine.scheduler_config.max_seq_len + 1)   # within the character limit
    with pytest.raises(ValueError, match=r"^bad_words has 1025 words: more than max_seq_len \(1024\)"):
        engine.make_request("Hi", SamplingParams(max_tokens=2, bad_words=many))
    engine.make_request("Hi", SamplingParams(max_tokens=2, bad_words=many[1:]))   # max_seq_len words: taken
    with pytest.raises(ValueError, match="^bad_words is not valid Unicode"):   # it named the prompt
        engine.make_request("Hi", SamplingParams(max_tokens=2, bad_words=["ok\ud800"]))
    out = smollm2_llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0, bad_words=["x" * 100]))
    assert out[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("field, value, match", [
    ("n", 0, "n must be"), ("max_tokens", -5, "max_tokens must be"), ("logit_bias", {-3: 5.0}, "logit_bias"),
    ("temperature", -1.0, "temperature"), ("seed", "abc", "seed"), ("logprobs", 1000, "logprobs"),
])
def test_sampling_params_changed_after_they_were_made_are_checked_again(smollm2_llm, field, value, match):
    """QA 25: n = 0 set on a made SamplingParams spun forever, a negative logit_bias id
    biased the vocabulary's end, logprobs = 1000 failed inside a step."""
    params = SamplingParams(max_tokens=2, temperature=0)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=match):
        smollm2_llm.generate([[1, 2, 3]], params)
    assert smollm2_llm.engine.kv.pool.num_free == smollm2_llm.engine.kv.pool.num_blocks


def test_a_request_keeps_the_sampling_params_it_was_given(smollm2_llm):
    """Each request checks and keeps its own copy (as vLLM clones them): a change made to the
    caller's object after the request was added does not reach it."""
    engine = smollm2_llm.engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    rid = engine.add_request([1, 2, 3], params)
    params.max_tokens = 50
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == 3


@pytest.mark.parametrize("messages, error, match", [
    ({"role": "user", "content": "Hi"}, TypeError, "messages must be a list"),
    ([[]], ValueError, "messages is empty"), ([], ValueError, "messages is empty"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ValueError, "text only"),
    ([{"role": "user", "content": None}], ValueError, r"messages\[0\]\.content must be a string"),
    ([{"role": "user", "content": "Hi"}, {"role": 3, "content": "x"}], ValueError, r"messages\[1\]\.role"),
    # a lone surrogate: named with its offset in the message (it was the templated text's)
    ([{"role": "user", "content": "Hi"}, {"role": "user", "content": "ok \ud800"}], ValueError,
     r"^messages\[1\]\.content is not valid Unicode text \(surrogates not allowed at character 3\)"),
])
def test_chat_messages_of_the_wrong_form_are_refused(smollm2_llm, messages, error, match):
    """QA 25: a single message dict was a KeyError 0, a None content a Jinja TypeError, and an
    empty conversation was generated from."""
    with pytest.raises(error, match=match):
        smollm2_llm.chat(messages, SamplingParams(max_tokens=2))


def test_chat_takes_openai_text_parts_as_the_http_server_does(smollm2_llm):
    """Parts are joined with "\n", as the HTTP server and vLLM join them (QA: LLM.chat joined
    them with "")."""
    params = SamplingParams(max_tokens=8, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    plain = [{"role": "user", "content": "What is the capital\nof France?"}]
    with_parts = smollm2_llm.chat(parts, params)[0]
    assert with_parts.prompt == smollm2_llm.chat(plain, params)[0].prompt
    assert "What is the capital\nof France?" in with_parts.prompt


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_kv_blocks=10 ** 12), "more than this machine's memory"), (dict(num_kv_blocks=10.5), "num_kv_blocks"),
    (dict(num_kv_blocks=True), "num_kv_blocks"), (dict(kv_cache_memory_bytes="1e6"), "kv_cache_memory_bytes"),
    (dict(num_threads=0), "num_threads"), (dict(max_waiting="5"), "max_waiting"), (dict(seed="x"), "seed"),
    (dict(speculative_config={"method": "ngram", "prompt_lookup_min": "1"}), "prompt_lookup_min"),
    (dict(speculative_config={"method": "ngram", "backoff_probe_interval": 0}), "backoff_probe_interval"),
    (dict(speculative_config={"method": "ngram", "draft_num_kv_blocks": 0}), "draft_num_kv_blocks"),
    (dict(speculative_config={"method": "ngram", "foo": 1}), "speculative_config: unknown key 'foo'"),  # TypeError (QA)
    # a truthy string turned the feature on (QA 25)
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be a bool"),
    (dict(enable_chunked_prefill="no"), "enable_chunked_prefill must be a bool"),
    (dict(verify_checksums="no"), "verify_checksums must be a bool"), (dict(offline="yes"), "offline must be a bool"),
    (dict(kv_cache_prefault="no"), "kv_cache_prefault must be a bool"),
])
def test_engine_options_of_the_wrong_type_or_range_are_named(tiny_model, kwargs, match):
    """QA 25: these failed inside numpy or ONNX Runtime naming nothing, or were accepted."""
    _, engine_dir = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match=match):
        LLM(engine_dir, **kwargs)


def test_a_speculative_config_changed_after_it_was_made_is_checked_again(tiny_model):
    from trtllm_lite.spec_decode.config import SpeculativeConfig

    _, engine_dir = tiny_model("llama-gqa")
    config = SpeculativeConfig(method="ngram")
    config.num_speculative_tokens = 0
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(engine_dir, speculative_config=config)


def test_stop_strings_without_a_tokenizer_are_refused(tiny_model):
    """A tiny test engine has no tokenizer, so no text to match stop strings against (QA 25: an
    AttributeError); stop_token_ids work."""
    _, engine_dir = tiny_model("llama-gqa")
    llm = LLM(engine_dir, num_kv_blocks=64)
    with pytest.raises(ValueError, match="stop needs a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop=["x"]))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, stop_token_ids=[9999 % 256]))
    assert len(out[0].outputs[0].token_ids) >= 1
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_bench_cli_refuses_counts_below_one_before_it_runs(tiny_model, tmp_path, capsys):
    """QA 25: --num-requests 0 failed with a KeyError after the latency runs, an unwritable
    --json after the whole run, and a vocabulary of 1,000 or fewer could not draw prompts."""
    from trtllm_lite.cli import main
    from trtllm_lite.commands.bench import random_prompts

    _, engine_dir = tiny_model("llama-gqa")
    for flags, message in ((["--num-requests", "0"], "--num-requests must be at least 1"),
                           (["--concurrency", "4", "0"], "--concurrency must be at least 1"),
                           (["--output-len", "0"], "--output-len must be at least 1"),
                           (["--json", str(tmp_path / "missing" / "out.json")], "--json"),
                           (["--json", str(tmp_path)], "--json"),
                           # the default 512-token TTFT prompt: past the tiny engine's 256 tokens
                           ([], "--prompt-lens 512 + 1 token (1) exceed the engine's max_model_len"),
                           (["--prompt-lens", "8", "--input-len", "250"], "--input-len 250 + --output-len")):
        assert main(["bench", "--engine", engine_dir, *flags]) != 0
        assert message in capsys.readouterr().err
    ids = random_prompts(2, 5, 256, seed=0)
    assert all(128 <= t < 256 for p in ids for t in p)
    out = tmp_path / "bench.json"
    assert main(["bench", "--engine", engine_dir, "--prompt-lens", "8", "--decode-tokens", "4",
                 "--num-requests", "2", "--input-len", "8", "--output-len", "4", "--concurrency", "2",
                 "--json", str(out)]) == 0
    assert json.load(open(out))["throughput"][0]["num_requests"] == 2
