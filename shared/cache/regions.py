"""A rank's cache memory: R regions, each one contiguous tensor of pages.

Region i holds page `b` of every logical block `b` at byte `b * page_bytes`; what the
bytes of a page mean (FA K/V in HND order, conv sections, SSM state, padding) is
the layout's business, read through `view()` at the offsets it gives. Each region is
allocated once, pre-faulted, and registered once with the rank's NIXL agent; it
must outlive every peer that holds this rank's metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from shared.cache.host_memory import host_buffer
from shared.cache.memory_place import MemoryPlace


class Registrar(Protocol):
    """What registers a rank's memory for transfers (the transport's `RankAgent`): the cache
    sits below the transport, so it names only this."""

    async def register(self, tensors: Sequence[torch.Tensor]) -> MemoryPlace: ...


def region_tensor(nbytes: int, device: torch.device, *, huge_pages: bool = True) -> torch.Tensor:
    """A zero-filled uint8 tensor of `nbytes` on `device`, every page touched now (a READ must
    not pay for page faults); on the host, on huge pages (host_memory.py)."""
    # Zero-filling touches every page: copying into never-touched pages ran ~5x slower.
    if device.type == "cpu":
        return host_buffer(nbytes, huge_pages=huge_pages)
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


class RankCache:
    """`num_regions` regions of `num_blocks * page_bytes` bytes on `device` (cpu or cuda:N)."""

    def __init__(
        self, num_regions: int, num_blocks: int, page_bytes: int, device: str | torch.device = "cpu", *, huge_pages: bool = True
    ) -> None:
        if num_regions < 1 or num_blocks < 1 or page_bytes < 1:
            raise ValueError(
                f"need at least one region, block and byte: got {num_regions} regions, {num_blocks} blocks, {page_bytes} B pages"
            )
        self.num_regions = num_regions
        self.num_blocks = num_blocks
        self.page_bytes = page_bytes
        self.device = torch.device(device)
        self.regions = [region_tensor(num_blocks * page_bytes, self.device, huge_pages=huge_pages) for _ in range(num_regions)]
        self.place = MemoryPlace.of_tensors(self.regions)

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.page_bytes

    def base_addresses(self) -> npt.NDArray[np.int64]:
        """Start address of each region (sent to peers in the handshake)."""
        return np.array([t.data_ptr() for t in self.regions], dtype=np.int64)

    async def register(self, agent: Registrar) -> MemoryPlace:
        """Register every region with the rank's agent (once)."""
        return await agent.register(self.regions)

    def blocks(self, region: int) -> torch.Tensor:
        """The region as a [num_blocks, page_bytes] uint8 view (index it with block id arrays)."""
        return self.regions[self._region(region)].view(self.num_blocks, self.page_bytes)

    def page(self, region: int, block: int) -> torch.Tensor:
        """The bytes of one block's page in one region (a view)."""
        return self.blocks(region)[self._block(block)]

    def view(
        self,
        region: int,
        block: int,
        byte_offset: int,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """A typed view of `shape` x `dtype` starting `byte_offset` bytes into a page."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        if byte_offset < 0 or byte_offset + nbytes > self.page_bytes:
            raise ValueError(f"view of {nbytes} B at offset {byte_offset} does not fit a {self.page_bytes} B page")
        start = self._block(block) * self.page_bytes + byte_offset
        if start % itemsize:
            raise ValueError(f"offset {byte_offset} is not aligned to {dtype} ({itemsize} B)")
        raw = self.regions[self._region(region)][start : start + nbytes]
        return raw.view(dtype).view(tuple(shape))

    def _region(self, region: int) -> int:
        if not 0 <= region < self.num_regions:
            raise IndexError(f"region {region} out of range [0, {self.num_regions})")
        return region

    def _block(self, block: int) -> int:
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks})")
        return block
