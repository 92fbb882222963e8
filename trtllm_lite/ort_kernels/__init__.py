"""C++ kernels for ONNX Runtime's CPU execution provider, built on first use.

ONNX Runtime custom operators in the ``trtllm_lite`` domain (``register.cc`` adds them):

* ``PagedAttention`` (``paged_attention.cc``): the attention op (``builder/paged_attention.py``),
  read straight from the paged KV pool, for every step's shape (decodes, prompts, mixed);
* ``RotarySplitQKV``, ``SiluAndMul``, ``QuantizeRows`` and ``DequantizeRows``
  (``elementwise.cc``): the fused QKV projection's output to rotated q, k and v, the fused
  gate/up projection's output to ``silu(gate) * up``, a w8a8 linear's input to uint8 planes
  and scales per token, and its integer GEMM's planes back to float32 (``builder/fused_ops.py``);
* ``AddBlockOffsets`` (``block_offsets.cc``): a block-quantized weight's float offsets (GGUF
  Q4_1's block mins) added to MatMulNBits' output (``builder/fused_ops.py``);
* ``QuantizedLinear`` / ``QuantizedLinearWithOffsets`` / ``QuantizedLinearSplit8``
  (``quantized_linear.cc``): a 4-bit (or split 8-bit) block-quantized linear at float32
  activations, in place of MatMulNBits (+ AddBlockOffsets) (``builder/fused_ops.py``,
  ``docs/quantization.md``);
* ``FloatLinear`` (``float_linear.cc``): a float32 linear over its weight in 32-row panels, in
  place of Gemm in a float32 engine's AVX-512 kernels graphs (``builder.fused_ops.use_float_linears``);
* ``DecoderLayer`` / ``FloatDecoderLayer`` (``decoder_layer.cc``): a Llama-family layer over 4-bit (or split
  8-bit) linears, or over ``FloatLinear``'s, in one node,
  its parts the kernels above (``builder.fused_ops.fuse_decoder_layers``; only in the
  ``*.kernels.onnx`` graphs, which only sessions with this library read: it has no function
  body).

The engines' plain graphs carry every op as an ONNX function too; ONNX Runtime runs the kernel
where the library is registered with the session and inlines the function otherwise, so a
missing compiler costs speed, never correctness.

The library is compiled with the host C++ compiler (``$CXX``, default ``g++``) for this CPU
(``-march=native``: AVX-512 loops where the CPU has AVX-512, AVX2 + FMA + F16C loops where it
has those, portable C++ otherwise) into a cache folder keyed by the sources, flags, compiler and CPU:
``$TRTLLM_LITE_CACHE_DIR/ort_kernels/<key>/`` (default ``~/.cache/trtllm_lite``). The first
build takes a few seconds; later processes load the cached file.

ONNX Runtime's Python wheel ships no C headers: ``ort_abi.h`` declares the few parts of its
stable C ABI (``OrtApi`` slots, ``OrtCustomOp``) that the kernel uses.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

LIBRARY_NAME = "libtrtllm_lite_ort_kernels.so"
SOURCES = ("register.cc", "paged_attention.cc", "elementwise.cc", "block_offsets.cc", "quantized_linear.cc",
           "decoder_layer.cc", "float_linear.cc",
           "kernel_common.h", "ort_abi.h")
CXX_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
             "-fno-math-errno", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-maybe-uninitialized")
MIN_ORT_API_VERSION = 17        # KernelContext_ParallelFor (ONNX Runtime 1.17)

_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_result: dict[str, object] = {}


class KernelBuildError(RuntimeError):
    """The C++ compiler failed on the kernels (its output is in the message)."""


def cache_dir() -> Path:
    """Root of the build cache (``$TRTLLM_LITE_CACHE_DIR``, default ``~/.cache/trtllm_lite``)."""
    root = os.environ.get("TRTLLM_LITE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "trtllm_lite")
    return Path(root) / "ort_kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def cpu_flags() -> str:
    """This CPU's flags line from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build_key(cxx: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((_HERE / name).read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    for part in (" ".join(CXX_FLAGS), version, cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_library(out_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernels (or reuse the cached build) and return the library's path.

    ``extra_flags`` go after :data:`CXX_FLAGS` (with an explicit ``out_dir``: tests build the
    AVX2 loops with ``-mno-avx512f`` and the portable ones with ``-mno-avx512f -mno-avx2 -mno-f16c``).

    Raises:
        KernelBuildError: no C++ compiler, or it failed (its output in the message).
    """
    cxx = _compiler()
    if cxx is None:
        raise KernelBuildError(f"no C++ compiler ({os.environ.get('CXX', 'g++')!r} not on PATH)")
    out_dir = out_dir or cache_dir() / _build_key(cxx)
    path = out_dir / LIBRARY_NAME
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    # compile to a private name, then rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir) as objects:
            _compile_and_link(cxx, extra_flags, Path(objects), tmp)
        os.chmod(tmp, 0o755)     # mkstemp made it 0600: others sharing the cache must load it
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _compile_and_link(cxx: str, extra_flags: tuple[str, ...], objects: Path, out: str) -> None:
    """Each source to an object file, all at once (the two largest take ~8 s each, all five
    ~23 s one after another), then one shared library ``out``."""
    units = [_HERE / name for name in SOURCES if name.endswith(".cc")]
    objs = [str(objects / (unit.stem + ".o")) for unit in units]
    procs = [subprocess.Popen([cxx, *CXX_FLAGS, *extra_flags, "-c", "-o", obj, str(unit)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for unit, obj in zip(units, objs)]
    failed = [(unit, err) for unit, proc in zip(units, procs)
              for err in [proc.communicate()[1]] if proc.returncode != 0]
    if failed:
        raise KernelBuildError(f"{cxx} failed on {', '.join(str(u) for u, _ in failed)}:\n"
                               + "".join(err for _, err in failed)[-4000:])
    proc = subprocess.run([cxx, *CXX_FLAGS, *extra_flags, "-o", out, *objs], capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelBuildError(f"{cxx} failed to link {', '.join(objs)}:\n{proc.stderr[-4000:]}")


def _loads(path: Path) -> bool:
    """Whether ``path`` is a loadable library exporting ``RegisterCustomOps``."""
    try:
        return hasattr(ctypes.CDLL(str(path)), "RegisterCustomOps")
    except OSError:
        return False


def library_path() -> str | None:
    """The kernels' library for ``SessionOptions.register_custom_ops_library``, built once per
    process (cached on disk; a cached file that does not load, e.g. truncated, is rebuilt);
    ``None``, with one warning, when it cannot be built here (the graphs then run the ops'
    ONNX function bodies)."""
    with _lock:
        if "path" not in _result:
            import onnxruntime as ort

            major, minor = (int(x) for x in ort.__version__.split(".")[:2])
            try:
                if (major, minor) < (1, MIN_ORT_API_VERSION):
                    raise KernelBuildError(f"onnxruntime {ort.__version__} < 1.{MIN_ORT_API_VERSION}")
                path = build_library()
                if not _loads(path):
                    path.unlink()
                    path = build_library()
                    if not _loads(path):
                        raise KernelBuildError(f"{path} was rebuilt but does not load")
                _result["path"] = str(path)
            except (KernelBuildError, OSError) as e:
                _result["path"] = None
                warnings.warn(f"trtllm-lite's ONNX Runtime kernels are unavailable, running the ops' "
                              f"ONNX function bodies instead (slower): {e}", stacklevel=2)
        return _result["path"]  # type: ignore[return-value]
