"""Write a Triton Inference Server model repository that serves a trtllm-lite engine.

Layout (``REPO`` = ``--output``, ``NAME`` = ``--model-name``)::

    REPO/NAME/config.pbtxt      Python backend, decoupled, TensorRT-LLM ensemble tensors,
                                engine path and runtime options as parameters
    REPO/NAME/1/model.py        imports TritonPythonModel from trtllm_lite.triton.model
    REPO/NAME/1/engine/         (only with copy_engine) the engine directory itself

A relative ``engine_dir`` parameter is resolved against the version directory (``REPO/NAME/1``),
so a repository written with ``copy_engine`` can be moved as a whole.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..engine_dir import load_engine_dir
from ..ensemble_tensors import CONFIG_DATA_TYPE, INPUTS, OUTPUTS, SEQUENCE_INDEX, TensorSpec


@dataclass(frozen=True)
class Option:
    """A ``config.pbtxt`` parameter: its type (``int`` / ``bool`` / ``str``), meaning and, for
    an ``int``, its least value."""

    name: str
    type: type
    help: str
    minimum: int | None = None


#: Parameters passed to ``LLMEngine`` (same names as ``trtllm-lite generate`` / ``serve``).
ENGINE_OPTIONS: tuple[Option, ...] = (
    Option("max_num_seqs", int, "most sequences in one step (default: the engine's build value)", minimum=1),
    Option("max_num_batched_tokens", int, "token budget of one step (default: build value; CPU backend at most 512)", minimum=1),
    Option("max_seq_len", int, "prompt + output tokens at most (default: build value)", minimum=2),
    Option("kv_cache_memory_bytes", int, "bytes for the K and V pools (default 1 GiB, capped)", minimum=1),
    Option("num_kv_blocks", int, "KV pool size in blocks (overrides kv_cache_memory_bytes)", minimum=1),
    Option("kv_cache_prefault", bool, "commit the KV pool's memory at start (default true; CPU)"),
    Option("enable_chunked_prefill", bool, "cut long prompts into budget-sized chunks (default true)"),
    Option("enable_prefix_caching", bool, "share KV blocks of equal prompt prefixes (default true)"),
    Option("max_waiting", int, "waiting requests at most; more are refused (UNAVAILABLE)", minimum=1),
    Option("num_threads", int, "ONNX Runtime threads (default: all cores)", minimum=1),
    Option("seed", int, "seed of the generator unseeded sampled requests draw from", minimum=0),
    Option("verify_checksums", bool, "check every engine file's sha256 at load (default true)"),
)
#: Parameters of the Triton model itself (TensorRT-LLM backend names).
MODEL_OPTIONS: tuple[Option, ...] = (
    Option("cancellation_check_period_ms", int,
           "how often (ms) cancelled requests are looked for and aborted (default 100)", minimum=1),
    Option("stats_check_period_ms", int,
           "how often (ms) the nv_trt_llm_* metrics are refreshed (default 100)", minimum=1),
)
OPTIONS = {o.name: o for o in ENGINE_OPTIONS + MODEL_OPTIONS}

#: Outputs beyond the ensemble table: TensorRT-LLM's ``sequence_index``, sent with every
#: response of a request with ``num_return_sequences`` > 1.
EXTRA_OUTPUTS: tuple[TensorSpec, ...] = (SEQUENCE_INDEX,)

MODEL_PY = '''"""Triton Python-backend model serving a trtllm-lite engine (written by `trtllm-lite triton-repo`).

The implementation is trtllm_lite.triton.model: the Python the backend stub runs must have
trtllm-lite installed (see docs/triton.md). Engine path and options: ../config.pbtxt.
"""
from trtllm_lite.triton.model import TritonPythonModel  # noqa: F401
'''

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_option(name: str, value: str):
    """A ``config.pbtxt`` parameter's string value, typed.

    Raises:
        ValueError: unknown name, a value that is not of the option's type, or an integer
            below the option's minimum (names both).
    """
    option = OPTIONS.get(name)
    if option is None:
        raise ValueError(f"unknown parameter {name!r}; known: engine_dir, {', '.join(OPTIONS)}")
    text = str(value).strip()
    if option.type is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"parameter {name} must be true or false, got {value!r}")
    if option.type is int:
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"parameter {name} must be an integer, got {value!r}") from None
        return check_minimum(option, number)
    return text


def check_minimum(option: Option, value: int) -> int:
    """``value`` if it is at least ``option.minimum``. Raises ``ValueError`` naming the option
    (a period of 0 ms made the model's watcher spin a core; 0 threads failed at load)."""
    if option.minimum is not None and value < option.minimum:
        raise ValueError(f"parameter {option.name} must be an integer >= {option.minimum}, got {value}")
    return value


def _format(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _tensor(spec: TensorSpec, is_input: bool) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    optional = "\n    optional: true" if spec.optional and is_input else ""
    return (f'  {{\n    name: "{spec.name}"\n    data_type: {CONFIG_DATA_TYPE[spec.datatype]}\n'
            f'    dims: [ {dims} ]{optional}\n  }}')


def config_pbtxt(model_name: str, engine_dir: str, options: dict | None = None) -> str:
    """The model's ``config.pbtxt`` text.

    ``max_batch_size: 1``: like the TensorRT-LLM ensemble, tensors carry a leading batch
    dimension, and a request holds one prompt; requests from all clients are batched inside
    trtllm-lite's scheduler (inflight batching), not by Triton. One CPU instance: a second
    would load a second engine.
    """
    params = {"engine_dir": engine_dir}
    for name, value in (options or {}).items():
        if value is not None:
            parse_option(name, _format(value))  # type check
            params[name] = _format(value)
    inputs = ",\n".join(_tensor(t, True) for t in INPUTS)
    outputs = ",\n".join(_tensor(t, False) for t in OUTPUTS + EXTRA_OUTPUTS)
    params_text = "\n".join(f'parameters: {{\n  key: "{k}"\n  value: {{ string_value: "{_escape(v)}" }}\n}}'
                            for k, v in params.items())
    return (f'# Written by `trtllm-lite triton-repo`: a trtllm-lite engine in the Python backend.\n'
            f'name: "{model_name}"\nbackend: "python"\nmax_batch_size: 1\n\n'
            f'# Streaming: any number of responses per request, the last flagged final.\n'
            f'model_transaction_policy {{\n  decoupled: true\n}}\n\n'
            f'# The TensorRT-LLM Triton ensemble\'s tensors (trtllm_lite/ensemble_tensors.py).\n'
            f'input [\n{inputs}\n]\n'
            f'output [\n{outputs}\n]\n\n'
            f'instance_group [\n  {{\n    count: 1\n    kind: KIND_CPU\n  }}\n]\n\n{params_text}\n')


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def write_model_repository(engine_dir: str | os.PathLike, output: str | os.PathLike,
                           model_name: str = "trtllm_lite", options: dict | None = None,
                           copy_engine: bool = False) -> Path:
    """Write (or overwrite) model ``model_name`` in repository ``output``; return its directory.

    Args:
        engine_dir: an engine made by ``trtllm-lite build`` (its manifest is checked now).
        output: the model repository (created if missing; other models in it are kept).
        model_name: the Triton model name clients address.
        options: :data:`ENGINE_OPTIONS` / :data:`MODEL_OPTIONS` values (None: not set).
        copy_engine: copy the engine into ``NAME/1/engine`` and refer to it relatively.

    Raises:
        EngineError: ``engine_dir`` is not a valid engine.
        ValueError: a bad model name, unknown option, or a limit above the engine's build value.
    """
    if not _NAME.match(model_name):
        raise ValueError(f"model_name must be letters, digits, '_', '-' or '.', got {model_name!r}")
    engine = load_engine_dir(str(engine_dir), verify_checksums=False)
    options = {k: v for k, v in (options or {}).items() if v is not None}
    for name, value in options.items():
        if name not in OPTIONS:
            raise ValueError(f"unknown parameter {name!r}; known: {', '.join(OPTIONS)}")
        if OPTIONS[name].type is int:
            check_minimum(OPTIONS[name], value)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len"):
        if name in options and not 1 <= options[name] <= engine.build[name]:
            raise ValueError(f"{name} must be in [1, {engine.build[name]}] (the engine's build value), "
                             f"got {options[name]}")
    if Path(output).exists() and not Path(output).is_dir():
        raise ValueError(f"output (--output) {str(output)!r} is a file, not a model repository directory")
    model_dir = Path(output) / model_name
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    engine_param = str(Path(engine_dir).resolve())
    if copy_engine:
        target = version_dir / "engine"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(engine_dir, target)
        engine_param = "engine"
    (model_dir / "config.pbtxt").write_text(config_pbtxt(model_name, engine_param, options))
    (version_dir / "model.py").write_text(MODEL_PY)
    return model_dir
