"""Per-sequence block tables over the block pool. The scheduler asks; this owns the blocks."""
from __future__ import annotations

from .block_pool import BlockPool
from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows block tables on demand and frees them the moment a sequence ends.

    Waste is at most one partly filled block per sequence (PagedAttention, Kwon et al. 2023).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make ``seq``'s block table cover ``num_computed_tokens + num_new_tokens`` tokens.

        Returns False (and allocates nothing) when the pool has too few free blocks.
        """
        need = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool."""
        self.pool.free(seq.block_table)
        seq.block_table = []

    def stats(self, running: list[Sequence]) -> dict[str, float]:
        """Blocks used/free and waste: allocated slots minus tokens held (fraction)."""
        allocated = sum(len(s.block_table) for s in running) * self.block_size
        held = sum(min(s.num_computed_tokens, len(s.block_table) * self.block_size) for s in running)
        return {"num_blocks": self.pool.num_blocks, "blocks_used": self.pool.num_used,
                "blocks_free": self.pool.num_free,
                "kv_waste_fraction": (allocated - held) / allocated if allocated else 0.0}
