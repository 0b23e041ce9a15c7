"""Two real NIXL agents in this process: `reader` pulls from `source` (UCX over DRAM)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest_asyncio
import torch

from shared.cache.regions import RankCache
from shared.transport.agent import PreppedList, RankAgent

NUM_BLOCKS, PAGE = 64, 4096


def block_descs(cache: RankCache) -> npt.NDArray[np.int64]:
    """Nx2 (address, length) of every block of region 0; descriptor id = block id."""
    starts = int(cache.base_addresses()[0]) + np.arange(cache.num_blocks, dtype=np.int64) * cache.page_bytes
    return np.stack([starts, np.full(cache.num_blocks, cache.page_bytes, dtype=np.int64)], axis=1)


@dataclass
class Pair:
    reader: RankAgent
    source: RankAgent
    reader_cache: RankCache
    source_cache: RankCache
    local: PreppedList
    remote: PreppedList


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[Pair]:
    reader = await RankAgent.create("decode", 0)
    source = await RankAgent.create("prefill", 0)
    reader_cache = RankCache(1, NUM_BLOCKS, PAGE)
    source_cache = RankCache(1, NUM_BLOCKS, PAGE)
    # Every 8 bytes distinct, so a block read from the wrong place is noticed.
    source_cache.regions[0].view(torch.int64).copy_(torch.arange(source_cache.region_bytes // 8) + (1 << 40))
    await reader_cache.register(reader)
    await source_cache.register(source)
    name = await reader.add_remote(await source.metadata())
    local = await reader.prep_local(block_descs(reader_cache))
    remote = await reader.prep_remote(name, block_descs(source_cache), source_cache.place)
    yield Pair(reader, source, reader_cache, source_cache, local, remote)
    await reader.aclose()
    await source.aclose()
