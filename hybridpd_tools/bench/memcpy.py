"""The memory-bandwidth limit: one torch copy of the same number of bytes, in one process, on
one thread (NIXL/cma is one copy by one thread per READ too). Both buffers are written first,
so the copy never pays for page faults; they are the services' kind of memory (host_memory.py).
With device cuda, both buffers are on cuda:0 and the copy is one device-to-device copy, timed
from a synchronized start to its completion."""

from __future__ import annotations

import time

import torch

from hybridpd_tools.bench.raw_memory import region_buffer


class CopyBaseline:
    def __init__(self, nbytes: int, *, huge_pages: bool = True, device: str = "cpu") -> None:
        self.nbytes = nbytes
        self._src = region_buffer(nbytes, device, 0, huge_pages=huge_pages).fill_(1)
        self._dst = region_buffer(nbytes, device, 0, huge_pages=huge_pages)

    def run(self) -> float:
        """Seconds for one copy of `nbytes` (single-threaded on the host)."""
        if self._src.is_cuda:
            torch.cuda.synchronize()
            started = time.perf_counter()
            self._dst.copy_(self._src)
            torch.cuda.synchronize()
            return time.perf_counter() - started
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            started = time.perf_counter()
            self._dst.copy_(self._src)
            return time.perf_counter() - started
        finally:
            torch.set_num_threads(threads)
