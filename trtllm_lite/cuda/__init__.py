"""CUDA kernels of the ``trtllm_lite::PagedAttention`` op, driven through ctypes.

The kernels live in ``plugins_cu/`` (build: ``plugins_cu/build.sh``); this package loads the
shared library lazily, so ``import trtllm_lite.cuda`` works without CUDA, and using it there
raises :class:`CudaKernelsUnavailable` with the reason. No torch, no cuda-python needed: device
pointers are plain ints, and :class:`DeviceBuffer` allocates through the library.
"""
from ._library import (CudaKernelError, CudaKernelsUnavailable, availability, build_info,
                       candidate_paths, load_library, use_library)
from .device import (DeviceBuffer, bf16_bits_to_float32, float32_to_bf16_bits,
                     from_device_dtype, synchronize, to_device_dtype)
from .paged_attention_cuda import (PagedAttentionResult, decode_num_splits,
                                   decode_workspace_size, paged_attention,
                                   paged_attention_decode, paged_attention_prefill,
                                   paged_kv_write, run_paged_attention, set_decode_kernel,
                                   set_decode_mma_prefetch, set_decode_policy)

__all__ = [
    "CudaKernelError", "CudaKernelsUnavailable", "DeviceBuffer", "PagedAttentionResult",
    "availability", "bf16_bits_to_float32", "build_info", "candidate_paths", "decode_num_splits",
    "decode_workspace_size", "float32_to_bf16_bits", "from_device_dtype", "load_library",
    "paged_attention", "paged_attention_decode", "paged_attention_prefill", "paged_kv_write",
    "run_paged_attention", "set_decode_kernel", "set_decode_mma_prefetch", "set_decode_policy", "synchronize",
    "to_device_dtype", "use_library",
]
