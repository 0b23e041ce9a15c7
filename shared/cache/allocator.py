"""Hands out a rank's logical cache blocks to requests, never one block to two holders.

Contiguous block runs matter on the wire: NIXL merges consecutive descriptors over
adjacent blocks into one, and per-descriptor cost dominates small-block READs
(65 536 scattered 4 KiB blocks move ~6x slower than one 256 MiB run). So a request
gets one contiguous run when a free run is long enough (the shortest such run, to
keep long runs for later), else the fewest runs that cover it (longest first).

Single-threaded: used from the event loop only.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

BlockIds = npt.NDArray[np.int64]


class BlocksExhausted(RuntimeError):
    """Not enough free blocks (the services answer RESOURCE_EXHAUSTED)."""

    def __init__(self, requested: int, free: int, total: int, holders: int) -> None:
        super().__init__(
            f"cache full: {requested} blocks requested, {free} of {total} free ({total - free} held by {holders} requests)"
        )
        self.requested = requested
        self.free = free
        self.total = total


class BlockAllocator:
    """Free/used accounting of `num_blocks` block ids, per request id."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks
        self._held: dict[str, list[BlockIds]] = {}

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def allocate(self, request_id: str, n: int, *, contiguous_preferred: bool = True) -> BlockIds:
        """Give `n` more blocks to the request (it may already hold some); returns their ids.

        Raises BlocksExhausted without changing anything when fewer than `n` are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self._num_free:
            raise BlocksExhausted(n, self._num_free, self.num_blocks, len(self._held))
        if n == 0:
            ids = np.empty(0, dtype=np.int64)
        elif contiguous_preferred:
            ids = self._fewest_runs(n)
        else:
            ids = np.flatnonzero(self._free)[:n].astype(np.int64)
        # Cheap guard for the one invariant that must never break.
        if not self._free[ids].all():
            raise AssertionError("allocator picked a block that is in use")
        self._free[ids] = False
        self._num_free -= n
        self._held.setdefault(request_id, []).append(ids)
        return ids.copy()

    def held(self, request_id: str) -> int:
        """How many blocks `request_id` holds (0: none)."""
        return sum(int(ids.size) for ids in self._held.get(request_id, ()))

    def free(self, request_id: str) -> int:
        """Return all of a request's blocks; returns how many. Freeing twice returns 0."""
        parts = self._held.pop(request_id, None)
        if parts is None:
            return 0
        ids = np.concatenate(parts)
        self._free[ids] = True
        self._num_free += int(ids.size)
        return int(ids.size)

    def transfer(self, from_id: str, to_id: str, ids: BlockIds) -> None:
        """Hand blocks `ids`, held by `from_id`, to `to_id` (decode's prefix cache keeps a
        finished request's prompt blocks this way); nothing changes unless `from_id` holds them all."""
        ids = np.asarray(ids, dtype=np.int64)
        parts = self._held.get(from_id)
        held = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        if not np.isin(ids, held).all() or np.unique(ids).size != ids.size:
            raise ValueError(f"{from_id!r} does not hold all of blocks {ids.tolist()}")
        if ids.size == 0:
            return
        rest = held[~np.isin(held, ids)]
        if rest.size:
            self._held[from_id] = [rest]
        else:
            del self._held[from_id]
        self._held.setdefault(to_id, []).append(ids.copy())

    def free_runs(self) -> tuple[BlockIds, BlockIds]:
        """(start, length) of every maximal run of free blocks, in block order."""
        padded = np.concatenate(([False], self._free, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        starts, ends = edges[0::2], edges[1::2]
        return starts.astype(np.int64), (ends - starts).astype(np.int64)

    def _fewest_runs(self, n: int) -> BlockIds:
        starts, lengths = self.free_runs()
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            best = fits[np.argmin(lengths[fits])]  # shortest run that fits, lowest start on ties
            return np.arange(starts[best], starts[best] + n, dtype=np.int64)
        order = np.argsort(-lengths, kind="stable")  # longest runs first
        covered = np.cumsum(lengths[order])
        k = int(np.searchsorted(covered, n)) + 1
        picked = order[:k]
        picked_len = lengths[picked].copy()
        picked_len[-1] -= int(covered[k - 1]) - n  # take only the head of the last run
        by_start = np.argsort(starts[picked])  # ascending ids keep runs adjacent in descriptor order
        picked, picked_len = picked[by_start], picked_len[by_start]
        offsets = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(picked_len) - picked_len, picked_len)
        return np.repeat(starts[picked], picked_len) + offsets
