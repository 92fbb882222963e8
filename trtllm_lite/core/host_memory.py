"""Host memory for the CPU KV pools: how much there is, and committing a pool's pages at start."""
from __future__ import annotations

import os

import numpy as np


def physical_memory_bytes() -> int:
    """The machine's RAM in bytes (``sysconf``; 2**62 where it cannot say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


#: The error of a pool that would not fit (its bytes, the bytes available).
KV_POOL_TOO_LARGE = ("the KV pools ({} bytes) are larger than the memory available now ({} bytes): lower "
                     "kv_cache_memory_bytes or num_kv_blocks (serve: --kv-cache-memory-bytes, --num-kv-blocks; "
                     "speculative decoding: draft_num_kv_blocks in speculative_config), or pass "
                     "kv_cache_prefault=False (--no-kv-cache-prefault) to commit the pool as it is used")


def available_memory_bytes() -> int:
    """Memory the host can give this process now, in bytes (``MemAvailable`` of
    ``/proc/meminfo``; :func:`physical_memory_bytes` where that cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory_bytes()


def prefault(pools: tuple[np.ndarray, ...], num_threads: int | None = None) -> None:
    """Write every page of ``pools`` once (zeros), from ``num_threads`` threads.

    ``np.zeros`` maps memory the host commits page by page at its first write. Written from
    inside a step, a first write stalls the thread that takes the fault while the others
    wait for it at the operator's end, and on a VM each fault may also wait for the host
    to back the page: the 64 random-length requests of ``tools/bench.py`` (SmolLM2 fp32,
    2 GiB pool, 2 cores) ran 1.03-1.10x faster with the pool written first (alternating
    processes), which took 1.6-2.5 s. GPU pools are committed at allocation in the same way.

    Args:
        pools: C-contiguous arrays, each ``[num_layers, num_blocks, ...]``; written in
            place with zeros (their values do not change: ``np.zeros`` made them).
        num_threads: writer threads (default: all cores); numpy releases the GIL while it
            fills.
    """
    from concurrent.futures import ThreadPoolExecutor

    parts = [layer for pool in pools for layer in pool]    # one slice per layer
    with ThreadPoolExecutor(max(1, num_threads or os.cpu_count() or 1)) as ex:
        list(ex.map(lambda a: a.fill(0), parts))
