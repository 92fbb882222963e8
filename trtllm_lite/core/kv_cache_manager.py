"""Per-sequence block tables over the block pool, with prefix caching and copy-on-write.

The scheduler asks; this owns the blocks. Prefix caching keys every full block by a hash
chain (as vLLM's automatic prefix caching does)::

    hash(block i) = sha256(hash(block i-1) || token ids of block i || cache_salt if i == 0)

so equal hashes mean equal tokens at equal positions: equal K/V. A new sequence reuses the
longest chain of cached blocks, up to one token short of its whole length (the last token
is always computed, to get its logits).
"""
from __future__ import annotations

import hashlib

import numpy as np

from .block_pool import BlockPool
from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def hash_block(parent: bytes, token_ids: list[int], salt: str | None) -> bytes:
    """A full block's prefix-cache key (32 bytes, SHA-256): the parent block's key, then the
    block's token ids as int64, then ``cache_salt`` when given, so a key names the whole
    prefix up to and including this block (vLLM's automatic prefix caching; the salt keeps
    tenants' caches apart)."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, np.int64).tobytes())
    if salt:
        h.update(b"salt:" + salt.encode())
    return h.digest()


class KVCacheManager:
    """Grows block tables on demand and frees them the moment a sequence ends.

    Waste is at most one partly filled block per sequence (PagedAttention, Kwon et al. 2023).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between sequences with equal prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.pending_copies: list[tuple[int, int]] = []   # (src, dst) blocks the runner copies
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # -- prefix cache ---------------------------------------------------------------------
    def block_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of ``seq``'s full blocks, extended as tokens arrive (kept on the sequence)."""
        b, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), len(seq.token_ids) // b):
            parent = hashes[i - 1] if i else b""
            hashes.append(hash_block(parent, seq.token_ids[i * b:(i + 1) * b], None if i else seq.cache_salt))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest chain of cached blocks that starts ``seq`` (nothing is taken yet).

        Requests that want prompt logprobs compute their whole prompt (no hits)."""
        if (not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table
                or seq.params.prompt_logprobs is not None):
            return []
        hashes = self.block_hashes(seq)
        limit = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for h in hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the last step filled, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes(seq)
        for i in range(seq.num_registered_blocks, full):
            self.pool.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = full

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Cover ``num_computed_tokens + num_new_tokens`` tokens (after taking the cached
        ``computed_blocks``). Returns False, changing nothing, if the pool is short.

        A partly filled block shared with a forked sibling (``n > 1``) is copied before the
        sequence writes into it (copy-on-write); the copy is queued in ``pending_copies``.
        """
        b = self.block_size
        computed = list(computed_blocks)
        start = seq.num_computed_tokens + len(computed) * b
        need = blocks_for(start + num_new_tokens, b) - len(seq.block_table) - len(computed)
        cow = (start % b != 0 and start // b < len(seq.block_table)
               and self.pool.ref_counts[seq.block_table[start // b]] > 1)
        reviving = sum(1 for blk in computed if self.pool.ref_counts[blk] == 0)
        if max(need, 0) + cow + reviving > self.pool.num_free:
            return False
        if computed:
            self.pool.touch(computed)
            seq.block_table.extend(computed)
            seq.num_computed_tokens = start
            seq.num_registered_blocks = len(computed)
            if seq.num_preemptions == 0:   # the first admission's hit, prompt tokens only (a
                # readmitted sequence also finds its own output's blocks: QA saw 336 of 300)
                seq.num_cached_tokens = min(start, seq.num_prompt_tokens)
        if cow:
            old = seq.block_table[start // b]
            (new,) = self.pool.allocate(1)
            self.pool.free([old])
            seq.block_table[start // b] = new
            self.pending_copies.append((old, new))
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of ``parent``'s blocks with ``child`` (one more reference each)."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.num_registered_blocks = parent.num_registered_blocks
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks (cached ones stay findable until evicted)."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def stats(self, running: list[Sequence]) -> dict[str, float]:
        """Blocks used/free/cached, waste (allocated slots minus tokens held, as a fraction
        of allocated slots) and the prefix-cache hit rate (hit / queried prompt tokens)."""
        allocated = sum(len(s.block_table) for s in running) * self.block_size
        held = sum(min(s.num_computed_tokens, len(s.block_table) * self.block_size) for s in running)
        return {"num_blocks": self.pool.num_blocks, "blocks_used": self.pool.num_used,
                "blocks_free": self.pool.num_free, "blocks_cached": self.pool.num_cached,
                "kv_waste_fraction": (allocated - held) / allocated if allocated else 0.0,
                "prefix_query_tokens": self.prefix_query_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefix_hit_rate": (self.prefix_hit_tokens / self.prefix_query_tokens
                                    if self.prefix_query_tokens else 0.0)}
