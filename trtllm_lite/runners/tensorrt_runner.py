"""TensorRT and TensorRT-RTX model runner (CUDA, through cuda-python; no torch).

Engines come from :mod:`builder.compile_tensorrt`: one ``model.plan`` with a ``prefill`` and a
``decode`` optimization profile; each profile gets its own execution context over the same
weights, and both share one activation buffer (they never run at once). Everything a step
touches lives on the GPU:

* KV pools: one device allocation each for K and V, ``[num_layers, num_blocks, block_size,
  num_kv_heads, head_dim]`` in the engine's precision (``--dtype``); layer ``i``'s
  slice is bound once as ``key_cache.{i}`` / ``value_cache.{i}``. Never copied to the host.
* New K/V: TensorRT (``kv_write="in_op"``): the PagedAttention plugin writes them into the
  pools; ``key_cache_out.{i}`` is bound to the same address as ``key_cache.{i}`` (the plugin's
  outputs alias its pool inputs). TensorRT-RTX (``kv_write="runtime"``): the engine returns
  ``new_keys``/``new_values`` on the device and :meth:`TensorRTRunner._store_kv` copies each run
  of consecutive slots with one ``cudaMemcpy2DAsync`` over all layers (device to device).
* Step inputs (int64) are copied host to device per step (tokens and block tables: bytes, not
  pools); logits ``[N, vocab]`` float32 come back to the host for the sampler.

Importing this module needs neither TensorRT nor cuda-python; :class:`TensorRTRunner` raises
:class:`TensorRTUnavailable` naming the missing package, or :class:`CudaUnavailable` when there
is no usable GPU.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

from ..engine_dir import EngineDir, tensorrt_kv_cache_dtype_ok
from .base import StepBatch, StepInputs, build_step_inputs

MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}      # backend -> module
PACKAGES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt-rtx"}     # backend -> PyPI name
EXTRAS = {"tensorrt": "tensorrt", "tensorrt-rtx": "rtx"}                 # pip extra of ours
PLUGIN_DIR = Path(__file__).resolve().parents[2] / "plugins_cu" / "tensorrt_plugin"
PLUGIN_LIBRARY = "libtrtllm_lite_trt_plugin.so"
_INT_INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens",
               "query_start_loc", "logits_indices")
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


class TensorRTUnavailable(ImportError):
    """A package the TensorRT backends need (tensorrt, tensorrt-rtx, cuda-python) is missing."""


class CudaUnavailable(RuntimeError):
    """cuda-python is installed but no CUDA GPU / driver can be used."""


def import_tensorrt(backend: str):
    """The ``tensorrt`` / ``tensorrt_rtx`` module for ``backend``.

    Raises:
        ValueError: ``backend`` is not a TensorRT backend.
        TensorRTUnavailable: the package is missing (the message names it and the pip extra).
    """
    if backend not in MODULES:
        raise ValueError(f"backend {backend!r} is not a TensorRT backend; choose from {tuple(MODULES)}")
    return _import(MODULES[backend], PACKAGES[backend], f"backend {backend!r}",
                   f"pip install trtllm-lite[{EXTRAS[backend]}]")


def _import(module: str, package: str, who: str, install: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TensorRTUnavailable(f"{who} needs the Python package {package!r}, which is not "
                                  f"installed ({exc}); install it with `{install}`") from None


def plugin_library() -> Path | None:
    """The built C++ plugin (``$TRTLLM_LITE_TRT_PLUGIN_LIB`` or
    ``plugins_cu/tensorrt_plugin/build/``), or None (the Python plugin is used)."""
    env = os.environ.get("TRTLLM_LITE_TRT_PLUGIN_LIB")
    path = Path(env) if env else PLUGIN_DIR / "build" / PLUGIN_LIBRARY
    return path if path.is_file() else None


def load_python_plugin():
    """Import ``plugins_cu/tensorrt_plugin/paged_attention_plugin.py`` (kept beside the C++
    plugin, outside the package) once; works without TensorRT."""
    name = "trtllm_lite_trt_plugin"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PLUGIN_DIR / "paged_attention_plugin.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def register_plugin(trt) -> str:
    """Make ``trtllm_lite::PagedAttention`` known to ``trt``'s plugin registry: the C++ library
    when built (returns ``"library"``), else the Python plugin (``"python"``)."""
    library = plugin_library()
    if library is not None:
        trt.get_plugin_registry().load_library(str(library))
        return "library"
    load_python_plugin().register(trt)
    return "python"


def scatter_runs(slot_mapping: np.ndarray) -> np.ndarray:
    """Runs of consecutive tokens whose slots are consecutive: ``[R, 3]`` int64 rows
    ``(first token, first slot, length)``. A prefill chunk is one run per KV block it touches;
    a decode step one run per sequence."""
    slots = np.asarray(slot_mapping, np.int64)
    if slots.size == 0:
        return np.zeros((0, 3), np.int64)
    starts = np.flatnonzero(np.r_[True, np.diff(slots) != 1])
    lengths = np.diff(np.r_[starts, slots.size])
    return np.stack([starts, slots[starts], lengths], axis=1)


class _Cuda:
    """The few CUDA runtime calls the runner makes (cuda-python's ``cuda.bindings.runtime``)."""

    def __init__(self):
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            rt = _import("cuda.cudart", "cuda-python", "the TensorRT runner", "pip install cuda-python")
        self.rt = rt
        err, count = rt.cudaGetDeviceCount()
        if err != rt.cudaError_t.cudaSuccess or count == 0:
            why = f"cudaGetDeviceCount returned {err.name}" if count is None or err else "no CUDA device"
            raise CudaUnavailable(f"the TensorRT runner needs a CUDA GPU: {why}")
        self.stream = self.check(rt.cudaStreamCreate())
        self._buffers: list[int] = []

    def check(self, result):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA call failed: {err.name}")
        return values[0] if len(values) == 1 else values

    def malloc(self, nbytes: int, zero: bool = False) -> int:
        ptr = int(self.check(self.rt.cudaMalloc(max(int(nbytes), 1))))
        self._buffers.append(ptr)
        if zero:
            self.check(self.rt.cudaMemsetAsync(ptr, 0, nbytes, self.stream))
        return ptr

    def htod(self, dst: int, array: np.ndarray) -> None:
        self.check(self.rt.cudaMemcpyAsync(dst, array.ctypes.data, array.nbytes,
                                           self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def free(self, ptr: int) -> None:
        if ptr in self._buffers:
            self._buffers.remove(ptr)
            self.check(self.rt.cudaFree(ptr))

    def dtoh(self, array: np.ndarray, src: int) -> None:
        self.check(self.rt.cudaMemcpyAsync(array.ctypes.data, src, array.nbytes,
                                           self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))

    def dtod_2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int) -> None:
        self.check(self.rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                             self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))

    def synchronize(self) -> None:
        self.check(self.rt.cudaStreamSynchronize(self.stream))

    def close(self) -> None:
        for ptr in self._buffers:
            self.rt.cudaFree(ptr)
        self._buffers = []


class TensorRTRunner:
    """Runs steps on a TensorRT / TensorRT-RTX engine (same interface as the ONNX Runtime one).

    Args:
        engine: a validated engine directory with a ``tensorrt`` manifest section.
        num_kv_blocks: KV blocks in the pool (each ``block_size`` tokens, all layers); at most
            the engine's ``max_num_blocks`` (its optimization profiles' bound).
        num_threads: unused (the GPU runs the step); accepted for the common interface.
    Raises:
        ValueError: the engine has no TensorRT plan, its ``kv_cache_dtype`` is neither float32
            nor its ``dtype``, or
            ``num_kv_blocks`` is out of range.
        TensorRTUnavailable: tensorrt / tensorrt-rtx / cuda-python is not installed.
        CudaUnavailable: no usable GPU.
    """

    def __init__(self, engine: EngineDir, num_kv_blocks: int, num_threads: int | None = None):
        dtype = engine.build.get("dtype", "float32")
        if not tensorrt_kv_cache_dtype_ok(engine.kv_cache_dtype, dtype):   # (the builder refuses to build one)
            raise ValueError(f"engine {engine.path!r} has kv_cache_dtype {engine.kv_cache_dtype!r} with dtype "
                             f"{dtype!r}: the {engine.backend} backend's KV pools take the engine's precision "
                             "(--dtype), which its CUDA PagedAttention kernels read")
        info = engine.manifest.get("tensorrt")
        if not info:
            raise ValueError(f"engine {engine.path!r} has no TensorRT plan (backend {engine.backend!r})")
        if not 1 <= num_kv_blocks <= info["max_num_blocks"]:
            raise ValueError(f"num_kv_blocks must be in [1, {info['max_num_blocks']}] (the engine's "
                             f"optimization profiles), got {num_kv_blocks}")
        trt = import_tensorrt(engine.backend)
        self.cuda = _Cuda()
        if "plugin" in info:
            register_plugin(trt)
        m, b = engine.model, engine.build
        self.num_layers, self.vocab_size = m["num_layers"], m["vocab_size"]
        self.block_size, self.num_blocks = b["block_size"], num_kv_blocks
        self.kv_write, self.precision = info["kv_write"], info["precision"]
        self.profiles, self.profile_index = info["profiles"], info["profile_index"]
        self.kv_shape = (self.num_layers, num_kv_blocks, self.block_size, m["num_kv_heads"], m["head_dim"])
        self.row_bytes = m["num_kv_heads"] * m["head_dim"] * np.dtype(_STORAGE[self.precision]).itemsize
        self._trt_logger = trt.Logger(trt.Logger.WARNING)
        with open(engine.file(info["plan"]), "rb") as f:
            self.engine = trt.Runtime(self._trt_logger).deserialize_cuda_engine(f.read())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not load {engine.file(info['plan'])} (built for "
                               f"another TensorRT version or GPU?)")
        self._allocate(trt)

    # -- setup ----------------------------------------------------------------------------
    def _max_elements(self, name: str) -> int:
        return max(int(np.prod(p[name][2])) for p in self.profiles.values() if name in p)

    def _allocate(self, trt) -> None:
        cuda = self.cuda
        self.layer_bytes = layer_bytes = self.num_blocks * self.block_size * self.row_bytes
        self.key_cache = cuda.malloc(layer_bytes * self.num_layers, zero=True)
        self.value_cache = cuda.malloc(layer_bytes * self.num_layers, zero=True)
        self.addresses = {name: cuda.malloc(8 * self._max_elements(name)) for name in _INT_INPUTS
                          if any(name in p for p in self.profiles.values())}
        self.max_logits = self._max_elements("logits_indices")
        self.addresses["logits"] = cuda.malloc(4 * self.max_logits * self.vocab_size)
        for i in range(self.num_layers):
            for name, base in (("key_cache", self.key_cache), ("value_cache", self.value_cache)):
                self.addresses[f"{name}.{i}"] = self.addresses[f"{name}_out.{i}"] = base + i * layer_bytes
        if self.kv_write == "runtime":
            self.max_tokens = self._max_elements("input_ids")
            for name in ("new_keys", "new_values"):
                self.addresses[name] = cuda.malloc(self.num_layers * self.max_tokens * self.row_bytes)
        # one activation buffer for both contexts, sized per step (grown on demand)
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        names = [self.engine.get_tensor_name(t) for t in range(self.engine.num_io_tensors)]
        self.engine_inputs = {n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        self.contexts = {}
        for name, index in self.profile_index.items():
            context = self.engine.create_execution_context(strategy)
            context.set_optimization_profile_async(index, cuda.stream)
            for tensor in names:
                if tensor in self.addresses:
                    context.set_tensor_address(tensor, self.addresses[tensor])
            self.contexts[name] = context
        self._scratch, self._scratch_bytes = 0, 0
        cuda.synchronize()

    def _activation_memory(self, profile: str) -> None:
        """Size the shared activation buffer for this step (per-shape where TensorRT can say,
        else the profile's maximum) and hand it to the context."""
        context = self.contexts[profile]
        if hasattr(context, "update_device_memory_size_for_shapes"):
            need = int(context.update_device_memory_size_for_shapes())
        else:
            need = int(self.engine.get_device_memory_size_for_profile_v2(self.profile_index[profile]))
        if need > self._scratch_bytes:
            self.cuda.free(self._scratch)   # the previous step has finished (synchronized)
            self._scratch, self._scratch_bytes = self.cuda.malloc(need), need
        context.set_device_memory(self._scratch, self._scratch_bytes)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one block holds over all layers, K and V."""
        return 2 * self.num_layers * self.block_size * self.row_bytes

    # -- a step ---------------------------------------------------------------------------
    def _run(self, profile: str, inputs: StepInputs) -> np.ndarray:
        cuda, context = self.cuda, self.contexts[profile]
        num_logits = len(inputs.logits_indices)
        values = {name: np.ascontiguousarray(getattr(inputs, name), np.int64) for name in _INT_INPUTS}
        if num_logits == 0:               # the profiles start at one row: compute one, drop it
            values["logits_indices"] = np.zeros(1, np.int64)
        for name, array in values.items():
            if name in self.engine_inputs:
                cuda.htod(self.addresses[name], array)
                context.set_input_shape(name, array.shape)
        for i in range(self.num_layers):
            context.set_input_shape(f"key_cache.{i}", self.kv_shape[1:])
            context.set_input_shape(f"value_cache.{i}", self.kv_shape[1:])
        self._activation_memory(profile)
        if not context.execute_async_v3(cuda.stream):
            raise RuntimeError(f"TensorRT failed to run the {profile} step")
        if self.kv_write == "runtime":
            self._store_kv(inputs.slot_mapping)
        logits = np.empty((len(values["logits_indices"]), self.vocab_size), np.float32)
        cuda.dtoh(logits, self.addresses["logits"])
        cuda.synchronize()                # also keeps ``values`` alive until the copies ran
        return logits[:num_logits]

    def _store_kv(self, slot_mapping: np.ndarray) -> None:
        """Paged KV write on the device: ``pool[layer, slot] = new[layer, token]``, one 2-D copy
        (all layers) per run of consecutive slots."""
        num_tokens, row = len(slot_mapping), self.row_bytes
        for token, slot, length in scatter_runs(slot_mapping).tolist():
            for new, pool in (("new_keys", self.key_cache), ("new_values", self.value_cache)):
                self.cuda.dtod_2d(pool + slot * row, self.layer_bytes,
                                  self.addresses[new] + token * row, num_tokens * row,
                                  length * row, self.num_layers)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src -> dst`` in every layer, K and V, on the device (copy-on-write)."""
        block = self.block_size * self.row_bytes
        for src, dst in pairs:
            for pool in (self.key_cache, self.value_cache):
                self.cuda.dtod_2d(pool + dst * block, self.layer_bytes, pool + src * block,
                                  self.layer_bytes, block, self.num_layers)
        if pairs:
            self.cuda.synchronize()

    def execute(self, batch: StepBatch) -> np.ndarray:
        """Run one step; return logits ``[batch.num_logits, vocab]`` float32.

        A step with any multi-token sequence runs on the ``prefill`` profile (decodes ride
        along, weights read once); an all-decode step on the ``decode`` profile.
        """
        seqs = batch.decode + batch.prefill
        if not seqs:
            return np.zeros((0, self.vocab_size), np.float32)
        return self._run("prefill" if batch.prefill else "decode", build_step_inputs(seqs, self.block_size))

    def close(self) -> None:
        """Free the device memory (the contexts and engine go first)."""
        self.contexts, self.engine = {}, None
        self.cuda.close()
