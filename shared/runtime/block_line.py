"""Requests and jobs waiting for cache blocks to start, served in the order they came.

While any of them waits, every block freed is set aside for the line (`reserved`), and only the
first in line takes from those. A newcomer may still start at once with blocks that were free
already (so a request that fits is not held behind one that waits for blocks still in use), but
never with blocks freed for the line: later arrivals, of any size, cannot starve a waiter by
taking the blocks it was waiting for. Running requests (growing by a block, forking) take any
free block, reserved or not: they hold blocks already and free them only by going on.

Pure bookkeeping on the event loop; the allocator stays the one owner of the blocks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class Claim(Enum):
    """Who asks for blocks, which says which free blocks it may take."""

    NEWCOMER = "newcomer"  # a request or job about to start: the free blocks not set aside
    FIRST_IN_LINE = "first in line"  # the longest waiter: every free block, those set aside first
    RUNNING = "running"  # growth and forks of a running request: every free block, the others first


@dataclass
class BlockLine:
    reserved: int = 0  # free blocks set aside for the line (never more than are free)
    _waiters: deque[asyncio.Event] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self._waiters)

    def usable(self, claim: Claim, num_free: int) -> int:
        """How many of the `num_free` free blocks `claim` may take."""
        return max(0, num_free - self.reserved) if claim is Claim.NEWCOMER else num_free

    def join(self) -> asyncio.Event:
        """A place at the end of the line; its event is set when it may try again."""
        turn = asyncio.Event()
        self._waiters.append(turn)
        return turn

    def first(self, turn: asyncio.Event) -> bool:
        return bool(self._waiters) and self._waiters[0] is turn

    def leave(self, turn: asyncio.Event) -> None:
        """`turn` got its blocks or gave up; the next in line may try with what is set aside."""
        was_first = self.first(turn)
        self._waiters.remove(turn)
        if not self._waiters:
            self.reserved = 0  # nobody waits: every free block is anyone's again
        elif was_first:
            self._waiters[0].set()

    def freed(self, n: int, num_free: int) -> None:
        """`n` blocks were freed (`num_free` free now): the line's, if anyone waits."""
        if self._waiters and n > 0:
            self.reserved = min(num_free, self.reserved + n)
            self._waiters[0].set()

    def taken(self, claim: Claim, n: int, num_free: int) -> None:
        """`claim` took `n` blocks (`num_free` free now): the first in line takes from what was
        set aside; a running request takes the other free blocks first."""
        if claim is Claim.FIRST_IN_LINE:
            self.reserved = max(0, self.reserved - n)
        self.reserved = min(self.reserved, num_free)
