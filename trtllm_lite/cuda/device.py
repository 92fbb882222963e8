"""Device buffers and 16-bit float conversions without torch or cuda-python.

:class:`DeviceBuffer` owns ``cudaMalloc`` memory through the kernel library's helpers; its
``ptr`` (an int) is what the launch functions take. Any other allocator's device pointer (CuPy,
PyTorch, cuda-python) works the same way.

bfloat16 has no numpy dtype: arrays of it travel as ``uint16`` bit patterns
(:func:`to_device_dtype`, :func:`bf16_bits_to_float32`).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ._library import check, load_library


class DeviceBuffer:
    """``nbytes`` of device memory; freed by :meth:`free` or when garbage-collected."""

    def __init__(self, nbytes: int):
        self._lib = load_library()
        self.nbytes = int(nbytes)
        ptr = ctypes.c_void_p()
        check(self._lib.tl_malloc(ctypes.byref(ptr), max(self.nbytes, 1)), "cudaMalloc")
        self.ptr: int = ptr.value

    @classmethod
    def from_array(cls, array: np.ndarray) -> "DeviceBuffer":
        buf = cls(array.nbytes)
        buf.upload(array)
        return buf

    def upload(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes > self.nbytes:
            raise ValueError(f"array of {array.nbytes} B does not fit a {self.nbytes} B buffer")
        check(self._lib.tl_memcpy_htod(self.ptr, array.ctypes.data, array.nbytes), "memcpy H2D")

    def download(self, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        check(self._lib.tl_memcpy_dtoh(out.ctypes.data, self.ptr, out.nbytes), "memcpy D2H")
        return out

    def fill_bytes(self, value: int) -> None:
        """Set every byte to ``value`` (0xFF in fp16/bf16 is a NaN: poison before a test)."""
        check(self._lib.tl_memset(self.ptr, value, self.nbytes), "cudaMemset")

    def free(self) -> None:
        if getattr(self, "ptr", None):
            self._lib.tl_free(self.ptr)
            self.ptr = 0

    def __del__(self):
        self.free()


def synchronize() -> None:
    """Wait for all device work (cudaDeviceSynchronize).

    Raises:
        CudaKernelError: a CUDA error.
    """
    check(load_library().tl_synchronize(), "cudaDeviceSynchronize")


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as uint16 bit patterns."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float -> the kernels' storage: ``float16`` array, or ``uint16`` bits for ``bfloat16``."""
    if dtype == "float16":
        return np.asarray(x, np.float16)
    if dtype == "bfloat16":
        return float32_to_bf16_bits(np.asarray(x, np.float32))
    raise ValueError(f"dtype must be float16 or bfloat16, got {dtype!r}")


def from_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of :func:`to_device_dtype`, as float32."""
    if dtype == "bfloat16":
        return bf16_bits_to_float32(x)
    return np.asarray(x, np.float32)


def storage_dtype(dtype: str) -> type:
    """The numpy dtype that holds ``dtype`` (``float16`` or ``bfloat16``) on the device:
    float16, or uint16 bits for bfloat16."""
    return np.float16 if dtype == "float16" else np.uint16
