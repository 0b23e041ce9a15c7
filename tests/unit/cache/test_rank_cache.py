from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.cache.memory_place import MemoryPlace
from shared.cache.regions import RankCache
from shared.transport.agent import RankAgent

pytestmark = pytest.mark.timeout(30)


def test_regions_are_separate_contiguous_zeroed_tensors() -> None:
    cache = RankCache(3, 16, 1024)
    assert len(cache.regions) == 3 and cache.region_bytes == 16 * 1024
    for tensor in cache.regions:
        assert tensor.dtype == torch.uint8 and tensor.is_contiguous() and tensor.numel() == 16 * 1024
        assert int(tensor.count_nonzero()) == 0
    bases = cache.base_addresses()
    assert bases.dtype == np.int64 and bases.tolist() == [t.data_ptr() for t in cache.regions]
    assert np.unique(bases).size == 3
    assert cache.place == MemoryPlace("DRAM", 0) and cache.device == torch.device("cpu")


def test_pages_and_blocks_are_views_of_the_region() -> None:
    cache = RankCache(2, 8, 64)
    cache.page(1, 5).fill_(7)
    region = cache.regions[1]
    assert int(region[5 * 64 : 6 * 64].min()) == 7 and int(region.count_nonzero()) == 64
    assert int(cache.regions[0].count_nonzero()) == 0
    assert cache.blocks(1).shape == (8, 64)
    assert torch.equal(cache.blocks(1)[5], cache.page(1, 5))


def test_typed_views_land_at_their_byte_offset() -> None:
    cache = RankCache(1, 4, 256)
    state = cache.view(0, 2, 64, (4, 8), torch.float32)
    state.copy_(torch.arange(32, dtype=torch.float32).view(4, 8))
    raw = cache.page(0, 2)[64 : 64 + 128]
    assert torch.equal(raw.view(torch.float32), torch.arange(32, dtype=torch.float32))
    assert int(cache.page(0, 2)[:64].count_nonzero()) == 0 and int(cache.page(0, 2)[192:].count_nonzero()) == 0
    assert cache.view(0, 3, 0, (2, 2), torch.bfloat16).shape == (2, 2)


def test_views_outside_a_page_or_misaligned_are_refused() -> None:
    cache = RankCache(2, 4, 256)
    with pytest.raises(ValueError, match="does not fit"):
        cache.view(0, 0, 200, (16,), torch.float32)
    with pytest.raises(ValueError, match="aligned"):
        cache.view(0, 0, 2, (4,), torch.float32)
    with pytest.raises(IndexError, match="block 4"):
        cache.page(0, 4)
    with pytest.raises(IndexError, match="region 2"):
        cache.page(2, 0)
    with pytest.raises(ValueError):
        RankCache(0, 4, 256)


def _resident_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_regions_are_pre_faulted() -> None:
    size = 64 << 20
    before = _resident_bytes()
    untouched = torch.empty(size, dtype=torch.uint8)  # negative control: not faulted in
    assert _resident_bytes() - before < size // 2
    before = _resident_bytes()
    cache = RankCache(1, 64, 1 << 20)
    assert _resident_bytes() - before >= size * 0.9
    del untouched, cache


@pytest.mark.asyncio
async def test_regions_register_with_the_rank_agent() -> None:
    agent = await RankAgent.create("cache-test", 0)
    try:
        cache = RankCache(2, 8, 4096)
        assert await cache.register(agent) == cache.place == agent.place
        # Descriptors inside any region can now be prepared; outside ones cannot.
        inside = np.array([[int(cache.base_addresses()[1]) + 4096, 4096]])
        await agent.prep_local(inside)
    finally:
        await agent.aclose()
