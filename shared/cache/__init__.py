"""Per-rank paged cache memory and its block allocator."""

from shared.cache.allocator import BlockAllocator, BlockIds, BlocksExhausted
from shared.cache.regions import RankCache

__all__ = ["BlockAllocator", "BlockIds", "BlocksExhausted", "RankCache"]
