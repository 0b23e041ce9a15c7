"""The memory-bandwidth limit: one torch copy of the same number of bytes, in one process, on
one thread (NIXL/cma is one copy by one thread per READ too). Both buffers are written first,
so the copy never pays for page faults; they are the services' kind of memory (host_memory.py)."""

from __future__ import annotations

import time

import torch

from shared.cache.host_memory import host_buffer


class CopyBaseline:
    def __init__(self, nbytes: int, *, huge_pages: bool = True) -> None:
        self.nbytes = nbytes
        self._src = host_buffer(nbytes, huge_pages=huge_pages).fill_(1)
        self._dst = host_buffer(nbytes, huge_pages=huge_pages)

    def run(self) -> float:
        """Seconds for one single-threaded copy of `nbytes`."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            started = time.perf_counter()
            self._dst.copy_(self._src)
            return time.perf_counter() - started
        finally:
            torch.set_num_threads(threads)
