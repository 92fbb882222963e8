"""Find and load ``libtrtllm_lite_kernels.so`` (built by ``plugins_cu/build.sh``) with ctypes.

Nothing here touches CUDA at import time, so importing the package works on machines without a
GPU, a driver or the built library; :func:`load_library` raises :class:`CudaKernelsUnavailable`
with the reason when the kernels cannot be used.

Search order: ``$TRTLLM_LITE_CUDA_LIB`` (a path to the .so; when set, the only place looked),
else ``<repo>/plugins_cu/build/``, then this package's folder (for an installed copy).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

LIBRARY_NAME = "libtrtllm_lite_kernels.so"
ABI_VERSION = 1
DTYPE_CODES = {"float16": 0, "bfloat16": 1}


class CudaKernelsUnavailable(RuntimeError):
    """The CUDA kernels cannot run here: library not built, no driver, or no GPU."""


class CudaKernelError(RuntimeError):
    """A kernel launch or CUDA call returned an error code."""

    def __init__(self, what: str, code: int, message: str):
        super().__init__(f"{what} failed: error {code}: {message}")
        self.code = code


def candidate_paths() -> list[Path]:
    """Where the library is looked for, in order (only the variable's path when it is set)."""
    if _override is not None:
        return [_override]
    env = os.environ.get("TRTLLM_LITE_CUDA_LIB")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent
    return [here.parents[1] / "plugins_cu" / "build" / LIBRARY_NAME, here / LIBRARY_NAME]


_P, _I, _F, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
# C signatures of include/trtllm_lite_kernels.h (pointers and streams travel as c_void_p).
_SIGNATURES = {
    "tl_abi_version": (_I, []),
    "tl_build_info": (ctypes.c_char_p, []),
    "tl_error_string": (ctypes.c_char_p, [_I]),
    "tl_paged_kv_write": (_I, [_I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P]),
    "tl_decode_workspace_size": (_S, [_I, _I, _I, _I, _I]),
    "tl_decode_num_splits": (_I, [_I, _I, _I, _I, _I]),
    "tl_set_decode_policy": (None, [_I, _I]),
    "tl_set_decode_kernel": (_I, [_I]),
    "tl_set_decode_mma_prefetch": (None, [_I]),
    "tl_paged_attention_decode": (_I, [_I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I,
                                       _F, _P, _S, _P]),
    "tl_paged_attention_prefill": (_I, [_I, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I,
                                        _I, _I, _F, _P]),
    "tl_paged_attention": (_I, [_I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I,
                                _I, _I, _I, _I, _F, _P, _S, _P]),
    "tl_device_count": (_I, [ctypes.POINTER(_I)]),
    "tl_malloc": (_I, [ctypes.POINTER(_P), _S]),
    "tl_free": (_I, [_P]),
    "tl_memcpy_htod": (_I, [_P, _P, _S]),
    "tl_memcpy_dtoh": (_I, [_P, _P, _S]),
    "tl_memset": (_I, [_P, _I, _S]),
    "tl_synchronize": (_I, []),
}

_lib: ctypes.CDLL | None = None
_device_ok = False
_override: Path | None = None


def use_library(path: str | os.PathLike | None) -> None:
    """Load the kernels from ``path`` from now on (None: back to the normal search).

    Tests use it to run the same checks on ``libtrtllm_lite_kernels_emu.so``, the CPU emulation
    build of the kernels (``plugins_cu/build.sh --emulation``).
    """
    global _lib, _device_ok, _override
    _lib, _device_ok = None, False
    _override = Path(path) if path is not None else None


def load_library(require_device: bool = True) -> ctypes.CDLL:
    """Load the kernel library once; with ``require_device``, also check a GPU is visible."""
    global _lib, _device_ok
    if _lib is None:
        found = [p for p in candidate_paths() if p.is_file()]
        if not found:
            raise CudaKernelsUnavailable(
                f"{LIBRARY_NAME} not found (looked in {', '.join(map(str, candidate_paths()))}); "
                "build it with plugins_cu/build.sh or set TRTLLM_LITE_CUDA_LIB")
        try:
            lib = ctypes.CDLL(str(found[0]))
        except OSError as exc:
            raise CudaKernelsUnavailable(f"cannot load {found[0]}: {exc}") from exc
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as exc:
                raise CudaKernelsUnavailable(
                    f"{found[0]} lacks {name}: built from older sources, rebuild it") from exc
            fn.restype, fn.argtypes = restype, argtypes
        if lib.tl_abi_version() != ABI_VERSION:
            raise CudaKernelsUnavailable(
                f"{found[0]} has ABI {lib.tl_abi_version()}, expected {ABI_VERSION}: rebuild it")
        _lib = lib
    if require_device and not _device_ok:
        count = ctypes.c_int(0)
        code = _lib.tl_device_count(ctypes.byref(count))
        if code != 0 or count.value == 0:
            reason = error_string(code) if code else "no CUDA device visible"
            raise CudaKernelsUnavailable(f"no usable CUDA GPU: {reason}")
        _device_ok = True
    return _lib


def build_info() -> str:
    """``"CUDA 13.0"`` for the real kernels, ``"CPU emulation"`` for the emulation build."""
    return load_library(require_device=False).tl_build_info().decode()


def error_string(code: int) -> str:
    """The message for a ``tl_*`` return code: the library's own codes (negative: bad dtype,
    head_dim, block_size, ...), else CUDA's (cudaGetErrorString)."""
    lib = load_library(require_device=False)
    return lib.tl_error_string(code).decode()


def check(code: int, what: str) -> None:
    """Raise :class:`CudaKernelError` for a nonzero return code of a ``tl_*`` call."""
    if code != 0:
        raise CudaKernelError(what, code, error_string(code))


def availability() -> tuple[bool, str]:
    """``(True, "")`` when the kernels can run here, else ``(False, reason)``."""
    try:
        load_library(require_device=True)
    except CudaKernelsUnavailable as exc:
        return False, str(exc)
    return True, ""
