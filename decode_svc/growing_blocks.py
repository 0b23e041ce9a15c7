"""A decoding request's blocks, grown on demand as its sequence crosses block boundaries.

Decode admits a request with blocks for its prompt and the first decode step (N + 1 tokens:
every boundary's first step fits), not for prompt + max_tokens: a request that stops early
never held what it did not use. Before each step of the step loop (shared/runtime/step_loop.py)
`try_room(1)` takes the next step's blocks on the event loop; while the cache is full that request
alone sits the steps out and waits (`room_for`) for frees until its deadline, then fails
RESOURCE_EXHAUSTED while the others carry on. Waiting happens on the loop, never on the compute
thread that every request shares, so a waiting request holds up nobody else.

How many tokens the next steps write is learnt from the engine itself: each step calls
`ensure(n)` before it writes position n - 1, so after the first step the next one needs one
token more than the most it asked for.
"""

from __future__ import annotations

import asyncio

from shared.engine.protocol import RequestBlocks
from shared.errors import ResourceExhausted
from shared.rpc.deadlines import wait_deadline
from shared.runtime.engine_host import EngineHost


def admission_tokens(prompt_len: int) -> int:
    """Tokens a request's blocks cover when it is admitted: the prompt and the first decode step."""
    return prompt_len + 1


class GrowingBlocks:
    def __init__(self, host: EngineHost, blocks: RequestBlocks, prompt_len: int) -> None:
        self.host = host
        self.blocks = blocks
        self._loop = asyncio.get_running_loop()
        self._prompt_len = prompt_len
        self._asked = 0  # the most tokens an engine step asked room for

    def fits(self, num_tokens: int) -> bool:
        need = self.host.blocks_per_group(num_tokens)
        return all(len(ids) >= n for ids, n in zip(self.blocks.block_ids, need))

    def ensure(self, num_tokens: int) -> RequestBlocks:
        """The engine's `EnsureCapacity`, on the compute thread: `room_for` took the blocks already.
        An engine that asks beyond them gets a grow without waiting (RESOURCE_EXHAUSTED if full)."""
        self._asked = max(self._asked, num_tokens)
        if not self.fits(num_tokens):
            # The allocator lives on the loop.
            future = asyncio.run_coroutine_threadsafe(self._grow(num_tokens), self._loop)
            self.blocks = future.result()
        return self.blocks

    async def _grow(self, num_tokens: int) -> RequestBlocks:
        return self.host.grow(self.blocks, num_tokens)

    def try_room(self, steps: int) -> bool:
        """Whether the next `steps` decode steps fit now, the blocks grown when free ones are
        there; False (nothing waited for) while the cache is full."""
        held = max(self._asked, self._prompt_len)
        if self.fits(held + steps):
            return True
        try:
            self.blocks = self.host.grow(self.blocks, held + steps)
        except ResourceExhausted:
            return False
        return True

    async def room_for(self, steps: int, deadline: float) -> int:
        """How many of the next `steps` decode steps may run now (at least 1), their blocks taken;
        while the cache is full and not one more step fits, wait for frees until shortly before
        `deadline` (event-loop time), then RESOURCE_EXHAUSTED naming the length it could not pass."""
        held = max(self._asked, self._prompt_len)  # tokens written before these steps
        if self.fits(held + steps):
            return steps
        try:
            self.blocks = self.host.grow(self.blocks, held + steps)
            return steps
        except ResourceExhausted:
            pass
        covered = next((k for k in range(steps - 1, 0, -1) if self.fits(held + k)), 0)
        if covered:
            return covered
        try:
            self.blocks = await self.host.grow_queued(self.blocks, held + 1, wait_deadline(deadline, self._loop.time()))
        except ResourceExhausted as e:
            raise ResourceExhausted(
                f"no cache blocks to grow this request past {held} tokens: {e.message}", reason="CACHE_FULL"
            ) from None
        return 1
