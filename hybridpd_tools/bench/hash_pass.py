"""The least a digest of every byte can cost: one xxh3-128 pass (the transfer digests' hash) over
the same number of bytes, in one process, on one thread, over memory already written. A digest
check that takes about this long hashes in place and copies nothing; what it takes beyond this
is gathering."""

from __future__ import annotations

import time

import xxhash

from shared.cache.host_memory import host_buffer


class HashPassBaseline:
    def __init__(self, nbytes: int, *, huge_pages: bool = True) -> None:
        self.nbytes = nbytes
        self._buffer = host_buffer(nbytes, huge_pages=huge_pages).fill_(1)
        self._bytes = self._buffer.numpy().data

    def run(self) -> float:
        """Seconds for one xxh3-128 pass over `nbytes`."""
        started = time.perf_counter()
        xxhash.xxh3_128(self._bytes).digest()
        return time.perf_counter() - started
