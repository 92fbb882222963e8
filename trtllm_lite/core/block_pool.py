"""The KV block pool: a free list and reference counts, nothing more."""
from __future__ import annotations

from collections import deque

import numpy as np


class BlockPool:
    """Hands out physical KV blocks ``0 .. num_blocks - 1``.

    Invariant (checked by :meth:`check`): ``num_free + num_used == num_blocks``, every
    reference count is >= 0, and a block is free exactly when its count is 0.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, np.int64)
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each). Raises ``RuntimeError`` if too few."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self.ref_counts[blocks] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block at zero goes back to the free list."""
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
            elif self.ref_counts[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")

    def check(self) -> None:
        """Assert the pool invariants (tests call this after every step)."""
        assert self.num_free + self.num_used == self.num_blocks
        assert (self.ref_counts >= 0).all(), "negative ref count"
        free = set(self._free)
        assert len(free) == len(self._free), "block twice in the free list"
        assert all(self.ref_counts[b] == 0 for b in free), "free block still referenced"
        assert int((self.ref_counts == 0).sum()) == len(free), "unreferenced block not free"
