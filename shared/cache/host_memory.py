"""Host (DRAM) buffers for cache regions: 2 MiB aligned and asking for transparent huge pages.

A READ between two processes on DRAM goes through UCX's cma transport: `process_vm_readv`
walks and pins the pages of both sides for every call, then copies. With 4 KiB pages that walk
is a large part of the cost. Many kernels, these machines included, run transparent huge pages
in "madvise" mode: only memory that asks (MADV_HUGEPAGE on a 2 MiB aligned range) gets them.
Measured here (`hybrid-pd bench transfer --huge-pages on|off`, nemotron 1 -> 1, 2k tokens):
raw NIXL 7.2-7.6 vs 4.8-5.1 GB/s, our service 7.0-7.25 vs 4.6-4.9 GB/s, memcpy ~9 either way.

Where the kernel has no THP (mode "never", or built without it) or the buffer is under 2 MiB,
this is plain memory.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE_BYTES = 2 * 1024 * 1024


def host_buffer(nbytes: int, *, huge_pages: bool = True) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of `nbytes`, every page touched now (a READ into
    never-touched pages ran ~5x slower). With `huge_pages` and at least 2 MiB, it starts on a
    2 MiB boundary inside an anonymous mapping advised MADV_HUGEPAGE; the tensor keeps the
    mapping alive."""
    if nbytes < 1:
        raise ValueError(f"a host buffer needs at least one byte, not {nbytes}")
    if not huge_pages or nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8).zero_()
    rounded = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    # One huge page more than needed, so a 2 MiB aligned start always fits inside.
    mapping = mmap.mmap(-1, rounded + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    # A kernel built without THP refuses the advice (EINVAL): plain pages, still aligned.
    with contextlib.suppress(OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, rounded)  # before the first touch: faults take huge pages
    buffer = whole[offset : offset + nbytes]
    buffer.zero_()
    return buffer
