"""The KV block pool: a free queue, reference counts and the prefix-cache hash map.

A block is *used* while some sequence references it (``ref_count > 0``) and *free*
otherwise. A free block that holds a full, hashed block of tokens stays findable through
its hash (a *cached* block) until the pool needs it.

Allocation takes, in order: free blocks that hold nothing cached (most recently freed
first), blocks never used yet, then cached blocks least-recently-freed first (evicting
them). So cached prefixes survive while other blocks are free, and on the CPU, where a pool
made with ``kv_cache_prefault=False`` is committed page by page as blocks are first
written, a server touches only as much of it as its peak load needs (an LRU queue over all
blocks walked the whole pool: SmolLM2 fp32 with a 2 GiB pool then peaked ~0.5 GB higher
after a few workloads).
"""
from __future__ import annotations

from collections import Counter, OrderedDict

import numpy as np


class BlockPool:
    """Hands out physical KV blocks ``0 .. num_blocks - 1``.

    Invariants (checked by :meth:`check`): ``num_free + num_used == num_blocks``; every
    reference count is >= 0; a block is in the free queue exactly when its count is 0;
    the hash map and each block's hash agree.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, np.int64)
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}                      # block hash -> block
        self._free_plain: OrderedDict[int, None] = OrderedDict()    # freed, nothing cached
        self._free_cached: OrderedDict[int, None] = OrderedDict()   # freed, findable by hash (LRU first)
        self._next_fresh = 0                                        # blocks >= this were never used
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached) + self.num_blocks - self._next_fresh

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash (used or free)."""
        return len(self.cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks: uncached ones first, then never-used ones, then cached ones
        least-recently-freed first (evicting them; see the module docstring).

        Raises:
            RuntimeError: fewer than ``n`` blocks are free.
        """
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free_plain:
                block, _ = self._free_plain.popitem(last=True)
            elif self._next_fresh < self.num_blocks:
                block, self._next_fresh = self._next_fresh, self._next_fresh + 1
            else:
                block, _ = self._free_cached.popitem(last=False)
                self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference to each block (a prefix-cache hit or a fork)."""
        for b in blocks:                    # check all first: misuse changes nothing
            if self.ref_counts[b] == 0 and b not in self._free_cached and b not in self._free_plain:
                raise RuntimeError(f"KV block {b} was never allocated")
        for b in blocks:
            if self.ref_counts[b] == 0:     # a free block in use again (cached, or freed plain)
                if b in self._free_cached:
                    del self._free_cached[b]
                else:
                    del self._free_plain[b]
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; at zero it is free (cached blocks join their
        queue's most-recently-freed end).

        Blocks are released last-first, so a sequence's tail blocks are evicted before its
        head (other requests are likelier to share a prefix than a tail).
        """
        for b, n in Counter(blocks).items():     # check all first: misuse changes nothing
            if self.ref_counts[b] < n:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                (self._free_plain if self.block_hashes[b] is None else self._free_cached)[b] = None

    # -- prefix cache ---------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by its hash (first writer wins on duplicates)."""
        if self.block_hashes[block] is None and block_hash not in self.cached:
            self.block_hashes[block] = block_hash
            self.cached[block_hash] = block

    def _evict(self, block: int) -> None:
        h = self.block_hashes[block]
        if h is not None:
            del self.cached[h]
            self.block_hashes[block] = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks stay allocated where referenced)."""
        self.cached.clear()
        self.block_hashes = [None] * self.num_blocks
        self._free_plain.update(self._free_cached)
        self._free_cached.clear()

    def check(self) -> None:
        """Assert the pool invariants (tests call this after every step)."""
        assert self.num_free + self.num_used == self.num_blocks
        assert (self.ref_counts >= 0).all(), "negative ref count"
        free = list(self._free_plain) + list(self._free_cached) + list(range(self._next_fresh, self.num_blocks))
        assert len(set(free)) == len(free), "a block is free twice"
        assert all(self.ref_counts[b] == 0 for b in free), "free block still referenced"
        assert int((self.ref_counts == 0).sum()) == len(free), "unreferenced block not free"
        assert all(self.block_hashes[b] is None for b in self._free_plain), "plain free block has a hash"
        assert all(self.block_hashes[b] is not None for b in self._free_cached), "cached free block has no hash"
        for h, b in self.cached.items():
            assert self.block_hashes[b] == h, "hash map and block hash disagree"
