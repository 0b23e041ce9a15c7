"""Reusable output arrays for a request's descriptor ids (`read_indices(..., buffers=...)`).

A long request has millions of ids per side. Written into fresh arrays, most of their cost is
the kernel mapping and zeroing new pages (measured here: 2.6 ms of page faults against 0.3 ms of
arithmetic for 1.2 M int32 ids per side); arrays that stay mapped skip it. Ids are only needed
until the READ is posted (NIXL copies them in `make_prepped_xfer`), so a few pairs of arrays,
taken per READ and given back once its post returned, serve any number of requests.

Small requests are not pooled: a few thousand ids cost microseconds either way.

Single-threaded: used from the event loop only.
"""

from __future__ import annotations

import numpy as np

from shared.layout.read_lists import IdArray

MIN_POOLED_IDS = 1 << 16  # below this, fresh arrays are as cheap
DEFAULT_MAX_IDLE = 4  # pairs kept between requests (each as large as the largest request so far)


class IdBuffers:
    """One READ's claim on the pool: call it with the id count to get (local, remote) arrays
    (at least that long), then `release()` once the READ was posted (or failed)."""

    def __init__(self, pool: IdBufferPool) -> None:
        self._pool = pool
        self._taken: tuple[IdArray, IdArray] | None = None

    def __call__(self, count: int) -> tuple[IdArray, IdArray]:
        if self._taken is not None:
            raise RuntimeError("one IdBuffers serves one read_indices call")
        self._taken = self._pool.take(count)
        return self._taken

    def release(self) -> None:
        taken, self._taken = self._taken, None
        if taken is not None:
            self._pool.give(taken)


class IdBufferPool:
    def __init__(self, max_idle: int = DEFAULT_MAX_IDLE) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle must be >= 0, got {max_idle}")
        self.max_idle = max_idle
        self._idle: list[tuple[IdArray, IdArray]] = []
        self.created = 0  # pairs allocated over the pool's life (reuse keeps this small)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def claim(self) -> IdBuffers:
        return IdBuffers(self)

    def take(self, count: int) -> tuple[IdArray, IdArray]:
        if count < 0:
            raise ValueError(f"cannot take {count} ids")
        if count >= MIN_POOLED_IDS:
            fits = [i for i, (local, _) in enumerate(self._idle) if len(local) >= count]
            if fits:
                best = min(fits, key=lambda i: len(self._idle[i][0]))  # the smallest that fits
                return self._idle.pop(best)
        self.created += 1
        return np.empty(count, dtype=np.int32), np.empty(count, dtype=np.int32)

    def give(self, arrays: tuple[IdArray, IdArray]) -> None:
        if len(arrays[0]) < MIN_POOLED_IDS or self.max_idle == 0:
            return
        self._idle.append(arrays)
        if len(self._idle) > self.max_idle:  # keep the largest: they serve every smaller request
            # By position: list.remove would compare arrays element by element.
            del self._idle[min(range(len(self._idle)), key=lambda i: len(self._idle[i][0]))]
