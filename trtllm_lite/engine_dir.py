"""The engine directory: the contract between the builder and the runtime.

::

    engine_dir/
      engine.json        manifest: format version, model + build config, graph I/O,
                         weight table, tokenizer files, sha256 of every file, tool versions
      prefill.onnx       graph, many packed tokens per sequence, logits at requested rows
      decode.onnx        graph, one token per sequence
      weights.bin        every weight once; both graphs point into it
      tokenizer.json, tokenizer_config.json, ...
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

ENGINE_FORMAT_VERSION = 1
MANIFEST = "engine.json"
KV_CACHE_DTYPES = ("float32", "float16")   # build["kv_cache_dtype"] (absent: float32)
FLOAT16_MAX = 65504.0   # float16's largest finite value: float16 pools store K/V saturated at +-it


def check_kv_cache_dtype_name(kv_cache_dtype: str) -> str:
    """``kv_cache_dtype`` itself when it is one of :data:`KV_CACHE_DTYPES`.

    Raises:
        ValueError: it is not (the message names kv_cache_dtype and the choices).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported: kv_cache_dtype must be one of "
                         f"{' or '.join(KV_CACHE_DTYPES)}")
    return kv_cache_dtype


def tensorrt_kv_cache_dtype_ok(kv_cache_dtype: str, dtype: str) -> bool:
    """Whether a TensorRT engine of precision ``dtype`` can have ``kv_cache_dtype``: its pools
    take ``dtype`` (the CUDA kernels read the network's type), so the default float32
    (follow ``dtype``) or ``dtype`` itself."""
    return kv_cache_dtype in ("float32", dtype)


def clip_to_float16_range(x):
    """A numpy array's values clipped to float16's finite range (+-:data:`FLOAT16_MAX`; NaN
    stays NaN): what a float16 pool stores for K/V past that range, never inf. Same shape and
    dtype (float32 K/V, rounded to float16 as they are assigned into a pool)."""
    return x.clip(-FLOAT16_MAX, FLOAT16_MAX)


class EngineError(ValueError):
    """The engine directory is missing, from another format version, or fails its checksums."""


@dataclass(frozen=True)
class EngineDir:
    """A validated engine directory: ``path`` and its parsed ``manifest``."""

    path: str
    manifest: dict

    @property
    def model(self) -> dict:
        return self.manifest["model"]

    @property
    def build(self) -> dict:
        return self.manifest["build"]

    @property
    def backend(self) -> str:
        return self.build["backend"]

    @property
    def kv_cache_dtype(self) -> str:
        """The build's ``kv_cache_dtype``: ``"float32"`` (also engines built before the
        option) or ``"float16"``."""
        return self.build.get("kv_cache_dtype", "float32")

    @property
    def kv_pool_dtype(self) -> str:
        """The element type the runtime's KV pools hold: :attr:`kv_cache_dtype` on ONNX
        Runtime; the engine's precision (``dtype``) on the TensorRT backends, whose pools
        and kernels follow it."""
        return self.kv_cache_dtype if self.backend == "onnxruntime" else self.build.get("dtype", "float32")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)


def sha256_file(path: str) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# the sizes the runtime computes with: positive integers in every manifest
_SIZES = {"model": ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size"),
          "build": ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_seq_len")}


def _check_sizes(manifest: dict, manifest_path: str) -> None:
    """Raise :class:`EngineError` naming the field where ``model`` or ``build`` is not an
    object or one of their :data:`_SIZES` is not a positive integer (a hand-edited manifest
    failed later with a KeyError or a ZeroDivisionError; QA 25)."""
    for section, fields in _SIZES.items():
        values = manifest.get(section)
        if not isinstance(values, dict):
            raise EngineError(f"{manifest_path}: {section!r} is missing or not an object")
        for name in fields:
            value = values.get(name)
            if type(value) is not int or value < 1:
                raise EngineError(f"{manifest_path}: {section}.{name} must be a positive integer, "
                                  f"got {value!r}")


def load_engine_dir(path: str, verify_checksums: bool = True,
                    expected_backend: str | None = None) -> EngineDir:
    """Read and validate ``path/engine.json``.

    Raises:
        EngineError: the directory or manifest is missing or malformed (not a JSON object, a
            size not a positive integer: the message names the field), its ``format_version`` differs from
            :data:`ENGINE_FORMAT_VERSION`, its backend differs from ``expected_backend``, its
            ``kv_cache_dtype`` is not one of :data:`KV_CACHE_DTYPES`, or a file is missing or
            fails its sha256 (the message names the file).
    """
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.exists(path) and not os.path.isdir(path):
        raise EngineError(f"engine directory {path!r} is a file, not a directory")
    if not os.path.isdir(path):
        raise EngineError(f"engine directory {path!r} does not exist (build one with `trtllm-lite build`)")
    if not os.path.isfile(manifest_path):
        raise EngineError(f"{path!r} is not an engine directory: {MANIFEST} is missing")
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{manifest_path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise EngineError(f"{manifest_path} is not a JSON object (a manifest)")
    version = manifest.get("format_version")
    if version != ENGINE_FORMAT_VERSION:
        raise EngineError(f"engine {path!r} has format_version {version!r}; this runtime reads "
                          f"format_version {ENGINE_FORMAT_VERSION}: rebuild it with this version")
    _check_sizes(manifest, manifest_path)
    backend = manifest["build"].get("backend")
    if expected_backend is not None and backend != expected_backend:
        raise EngineError(f"engine {path!r} was built for backend {backend!r}, not {expected_backend!r}")
    try:
        check_kv_cache_dtype_name(manifest["build"].get("kv_cache_dtype", "float32"))
    except ValueError as e:
        raise EngineError(f"engine {path!r}: {e}; rebuild it with --kv-cache-dtype") from None
    for name, digest in manifest.get("files", {}).items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise EngineError(f"engine file {name!r} is missing from {path!r}")
        if verify_checksums and sha256_file(file_path) != digest:
            raise EngineError(f"engine file {name!r} in {path!r} fails its sha256 checksum "
                              "(corrupted or modified since the build)")
    return EngineDir(os.path.abspath(path), manifest)
