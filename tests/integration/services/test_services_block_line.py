"""Requests waiting for blocks to start get them in the order they came (decode's real engine
host: reference engine, real allocator): blocks freed while any wait are set aside for the
first in line, a newcomer of any size starts only with blocks that were free already, running
requests grow into any free block, and a waiter leaving (served, past its deadline, cancelled)
passes its turn on. Each test builds the situation by holding and freeing blocks by hand, so
what it checks does not hang on timing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from shared.errors import ResourceExhausted
from shared.runtime.engine_host import EngineHost
from tests.integration.exactness.pair import service_pair
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]

MODEL = "tiny-mamba2"
ONE = 40  # tokens: the size of every hog, a request of two attention blocks and the Mamba pages


@pytest_asyncio.fixture
async def host() -> AsyncIterator[EngineHost]:
    async with service_pair(MODEL, 1, 1) as pair:
        yield pair.decode.host


def blocks(host: EngineHost, num_tokens: int) -> int:
    return sum(host.blocks_per_group(num_tokens))


def fill(host: EngineHost) -> list[str]:
    """Hold every block: requests of ONE tokens (hog0, hog1, ...) while one more fits, then
    single blocks."""
    keys: list[str] = []
    while host.allocator.num_free >= blocks(host, ONE):
        keys.append(f"hog{len(keys)}")
        host.allocate(keys[-1], ONE)
    for i in range(host.allocator.num_free):
        keys.append(f"crumb{i}")
        host.take(keys[-1], 1)
    assert host.allocator.num_free == 0 and len(keys) > 3
    return keys


def empty(host: EngineHost, keys: list[str]) -> None:
    for key in keys:
        host.free(key)
    assert host.allocator.num_used == 0 and len(host.line) == 0 and host.line.reserved == 0
    assert host.waiting_for_blocks == 0


async def test_a_waiter_gets_the_freed_blocks_before_a_newcomer_of_its_size(host: EngineHost) -> None:
    """A newcomer that arrives between a free and the waiter's waking (here: at once) does not
    take the blocks; without the line it did."""
    loop = asyncio.get_running_loop()
    held = fill(host)
    waiter = asyncio.ensure_future(host.allocate_queued("waiter", ONE, loop.time() + 30))
    await until(lambda: host.waiting_for_blocks == 1, timeout=10)
    host.free("hog0")  # room for one request of this size
    with pytest.raises(ResourceExhausted, match="set aside for the 1 requests waiting"):
        host.allocate("newcomer", ONE)
    newcomer = asyncio.ensure_future(host.allocate_queued("newcomer", ONE, loop.time() + 30))
    assert (await asyncio.wait_for(waiter, 10)).request_id == "waiter"
    assert not newcomer.done() and len(host.line) == 1
    host.free("waiter")
    assert (await asyncio.wait_for(newcomer, 10)).request_id == "newcomer"
    empty(host, [*held[1:], "newcomer"])


async def test_a_smaller_newcomer_cannot_take_blocks_freed_for_a_larger_waiter(host: EngineHost) -> None:
    """The starvation the line exists for: blocks freed one request at a time, each enough for a
    smaller newcomer, never for the waiter, went to the newcomers before."""
    loop = asyncio.get_running_loop()
    held = fill(host)
    big = asyncio.ensure_future(host.allocate_queued("big", 2 * ONE + 64, loop.time() + 30))
    await until(lambda: host.waiting_for_blocks == 1, timeout=10)
    assert (
        blocks(host, ONE) < blocks(host, 2 * ONE + 64) <= 2 * blocks(host, ONE) < blocks(host, ONE) + blocks(host, 2 * ONE + 64)
    )
    host.free("hog0")
    assert host.line.reserved == host.allocator.num_free > 0  # set aside for the line
    with pytest.raises(ResourceExhausted, match="set aside for the 1 requests waiting"):
        host.allocate("small", ONE)
    small = asyncio.ensure_future(host.allocate_queued("small", ONE, loop.time() + 30))
    await until(lambda: host.waiting_for_blocks == 2, timeout=10)
    host.free("hog1")  # enough for big, and what it leaves is too little for small
    got = await asyncio.wait_for(big, 10)
    assert got.request_id == "big" and not small.done()
    host.free("big")
    assert (await asyncio.wait_for(small, 10)).request_id == "small"
    empty(host, [*held[2:], "small"])


async def test_a_newcomer_that_fits_the_blocks_free_before_the_line_starts_at_once(host: EngineHost) -> None:
    """A request is not held behind one that waits for blocks still in use, as long as it needs
    only blocks that were free when that one began to wait (none freed for the line)."""
    loop = asyncio.get_running_loop()
    held = fill(host)
    host.free("hog0")  # free before anyone waits: anyone's
    big = asyncio.ensure_future(host.allocate_queued("big", 3 * ONE + 64, loop.time() + 30))
    await until(lambda: host.waiting_for_blocks == 1, timeout=10)
    assert host.line.reserved == 0
    small = await asyncio.wait_for(host.allocate_queued("small", ONE, loop.time() + 30), 1)
    assert small.request_id == "small" and not big.done()
    big.cancel()
    with pytest.raises(asyncio.CancelledError):
        await big
    empty(host, [*held[1:], "small"])


async def test_a_running_request_grows_into_blocks_set_aside_for_the_line(host: EngineHost) -> None:
    """Growth does not wait behind the line: a running request frees its blocks only by going on,
    so holding it back for a waiter could leave both waiting forever."""
    loop = asyncio.get_running_loop()
    running = host.allocate("running", 1)
    held = fill(host)
    big = asyncio.ensure_future(host.allocate_queued("big", 2 * ONE + 64, loop.time() + 30))
    await until(lambda: host.waiting_for_blocks == 1, timeout=10)
    host.free("hog0")
    reserved = host.line.reserved
    grown = host.grow(running, ONE + 32)
    assert sum(map(len, grown.block_ids)) > sum(map(len, running.block_ids))
    assert host.line.reserved < reserved and host.line.reserved <= host.allocator.num_free
    assert not big.done()
    big.cancel()  # woken by the free and cancelled before it ran: the cancel must not be lost
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(big, 5)
    empty(host, [*held[1:], "running"])


async def test_a_waiter_leaving_passes_its_turn_on(host: EngineHost) -> None:
    """The first in line gives up at its deadline: the next one gets the blocks set aside; a
    later one that passes its own deadline behind it fails RESOURCE_EXHAUSTED naming the line,
    and nothing stays counted or set aside."""
    loop = asyncio.get_running_loop()
    held = fill(host)
    big = asyncio.ensure_future(host.allocate_queued("big", 3 * ONE + 64, loop.time() + 1.0))
    await until(lambda: host.waiting_for_blocks == 1, timeout=10)
    small = asyncio.ensure_future(host.allocate_queued("small", ONE, loop.time() + 30))
    late = asyncio.ensure_future(host.allocate_queued("late", ONE, loop.time() + 0.5))
    await until(lambda: host.waiting_for_blocks == 3, timeout=10)
    host.free("hog0")  # enough for small, not for big: set aside while big is first
    with pytest.raises(ResourceExhausted, match="wait for blocks; still waiting behind earlier ones"):
        await asyncio.wait_for(late, 10)
    assert not small.done()
    with pytest.raises(ResourceExhausted, match="deadline"):
        await asyncio.wait_for(big, 10)
    assert (await asyncio.wait_for(small, 10)).request_id == "small"
    assert len(host.line) == 0 and host.line.reserved == 0 and host.waiting_for_blocks == 0
    empty(host, [*held[1:], "small"])


async def test_a_newcomer_behind_the_line_makes_the_caches_give_up_nothing(host: EngineHost) -> None:
    """Blocks the caches give up while requests wait go to the line, so a newcomer that cannot
    start does not make them give any up; the first in line does. The caches are stood for by
    the host's reclaim hook (what decode's prefix cache and state checkpoints install), freeing
    requests held as cache entries."""
    loop = asyncio.get_running_loop()
    held = fill(host)
    cache = [k for k in held if k.startswith("hog")][1:]
    asked: list[int] = []

    def reclaim(n: int) -> int:
        asked.append(n)
        freed = 0
        while freed < n and cache:
            freed += host.free(cache.pop())
        return freed

    big = asyncio.ensure_future(host.allocate_queued("big", 2 * ONE + 64, loop.time() + 30))
    await until(lambda: host.waiting_for_blocks == 1, timeout=10)
    host.reclaim = reclaim
    try:
        with pytest.raises(ResourceExhausted, match="cache full"):
            host.allocate("newcomer", ONE)
        assert asked == [] and not big.done()
        host.free("hog0")  # the first in line wakes, and its caches give up the rest
        got = await asyncio.wait_for(big, 10)
        assert asked and sum(map(len, got.block_ids)) == blocks(host, 2 * ONE + 64)
    finally:
        host.reclaim = None
    empty(host, [*held, "big"])  # freeing a key twice frees nothing
