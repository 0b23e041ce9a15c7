"""RankAgent against a second real agent in this process (UCX over DRAM)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from shared.cache.memory_place import MemoryPlace
from shared.transport.agent import RankAgent, agent_name
from shared.transport.errors import PeerMetadataRejected, TransportError

pytestmark = pytest.mark.timeout(30)


def test_agent_names_carry_engine_rank_and_incarnation() -> None:
    assert agent_name("prefill-a", 3, "beef") == "prefill-a-r3-beef"


@pytest.mark.asyncio
async def test_each_start_gets_a_new_incarnation_unless_given() -> None:
    first, second = await RankAgent.create("e", 0), await RankAgent.create("e", 0)
    fixed = await RankAgent.create("e", 0, incarnation="x")
    try:
        assert re.fullmatch(r"e-r0-[0-9a-f]{8}", first.name)
        assert first.name != second.name
        assert fixed.name == "e-r0-x"
    finally:
        for agent in (first, second, fixed):
            await agent.aclose()


@pytest.mark.asyncio
async def test_read_moves_exact_blocks_and_releases_its_handle(pair: Any) -> None:
    local_ids, remote_ids = np.array([3, 4, 5, 40]), np.array([10, 11, 12, 2])
    xfer = await pair.reader.post_read(pair.local, local_ids, pair.remote, remote_ids, b"r1")
    while await pair.reader.state(xfer) == "PROC":
        await asyncio.sleep(0.001)
        await pair.source.get_new_notifs()  # the source answers wire-up only when pumped
    assert xfer.nbytes == 4 * pair.reader_cache.page_bytes and xfer.peer == pair.source.name
    got, want = pair.reader_cache.blocks(0), pair.source_cache.blocks(0)
    assert torch.equal(got[local_ids], want[remote_ids])
    assert not torch.equal(got[local_ids], want[remote_ids + 1])  # negative control
    assert xfer.released and pair.reader.live_xfers == 0
    assert await pair.reader.state(xfer) == "DONE"


@pytest.mark.asyncio
async def test_notifications_travel_between_agents(pair: Any) -> None:
    await pair.reader.send_notif(pair.source.name, b"hello")
    received: dict[str, list[bytes]] = {}
    end = time.monotonic() + 5
    while not received and time.monotonic() < end:
        await pair.reader.get_new_notifs()  # progresses the sender's side of the wire-up
        received = await pair.source.get_new_notifs()
        await asyncio.sleep(0.001)
    assert received == {pair.reader.name: [b"hello"]}


@pytest.mark.asyncio
async def test_malformed_reads_are_refused_before_nixl(pair: Any) -> None:
    read = pair.reader.post_read
    with pytest.raises(ValueError, match="out of range"):
        await read(pair.local, [64], pair.remote, [0], b"")
    with pytest.raises(ValueError, match="out of range"):
        await read(pair.local, [-1], pair.remote, [0], b"")
    with pytest.raises(ValueError, match="2 local indices but 1 remote"):
        await read(pair.local, [0, 1], pair.remote, [0], b"")
    with pytest.raises(ValueError, match="non-empty"):
        await read(pair.local, [], pair.remote, [], b"")
    with pytest.raises(ValueError, match="local prepared list, then a remote"):
        await read(pair.remote, [0], pair.local, [0], b"")
    half = np.array([[int(pair.source_cache.base_addresses()[0]), 2048]])
    short_remote = await pair.reader.prep_remote(pair.source.name, half, pair.source_cache.place)
    with pytest.raises(ValueError, match="differ in length"):
        await read(pair.local, [0], short_remote, [0], b"")
    assert pair.reader.live_xfers == 0


@pytest.mark.asyncio
async def test_nixl_errors_become_transport_errors_that_say_what_failed(pair: Any) -> None:
    with pytest.raises(PeerMetadataRejected, match="nixlMismatchError"):  # typed: callers catch the class
        await pair.reader.add_remote(b"not metadata")
    with pytest.raises(TransportError, match=r"'nobody'.*nixlNotFoundError"):
        await pair.reader.prep_remote("nobody", np.array([[4096, 4096]]), MemoryPlace("DRAM", 0))
    outside = int(pair.reader_cache.base_addresses()[0]) + pair.reader_cache.region_bytes
    with pytest.raises(TransportError, match="outside its registered memory"):
        await pair.reader.prep_local(np.array([[outside, 4096]]))


@pytest.mark.asyncio
async def test_memory_is_registered_once_and_a_closed_agent_refuses_calls() -> None:
    agent = await RankAgent.create("once", 0)
    await agent.register([torch.zeros(4096, dtype=torch.uint8)])
    assert agent.place == MemoryPlace("DRAM", 0)
    with pytest.raises(RuntimeError, match="once"):
        await agent.register([torch.zeros(4096, dtype=torch.uint8)])
    await agent.aclose()
    assert agent.closed
    with pytest.raises(RuntimeError, match="closed"):
        await agent.metadata()
    await agent.aclose()  # closing twice is harmless


@pytest.mark.asyncio
async def test_all_nixl_calls_run_on_the_owner_thread(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[str] = set()
    nixl = pair.reader._agent
    original = nixl.get_new_notifs

    def spy(*args: Any) -> Any:
        threads.add(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(nixl, "get_new_notifs", spy)
    await asyncio.gather(*(pair.reader.get_new_notifs() for _ in range(8)))
    assert len(threads) == 1 and threads.pop().startswith(f"nixl-{pair.reader.name}")


@pytest.mark.asyncio
async def test_small_reads_post_inline_when_the_owner_thread_is_idle_and_queue_otherwise(
    pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.transport import agent as agent_module

    threads: list[str] = []
    nixl = pair.reader._agent
    original = nixl.make_prepped_xfer

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(nixl, "make_prepped_xfer", spy)
    owner = f"nixl-{pair.reader.name}"

    async def read(local_ids: list[int], remote_ids: list[int], notif: bytes) -> Any:
        posted = pair.reader.post_read(pair.local, np.array(local_ids), pair.remote, np.array(remote_ids), notif)
        inline_done = posted.done()
        xfer = await posted
        while await pair.reader.state(xfer) == "PROC":  # the first READ may wait for the wire-up
            await pair.source.get_new_notifs()
        got, want = pair.reader_cache.blocks(0), pair.source_cache.blocks(0)
        assert torch.equal(got[local_ids], want[remote_ids])
        return inline_done

    # 2 blocks of 4 KiB, owner idle: posted on this (event-loop) thread, done on return.
    assert await read([1, 2], [30, 31], b"a") is True
    assert threads[-1] == threading.current_thread().name
    # Owner thread busy with a call: the READ is queued behind it, not run beside it.
    release = threading.Event()
    blocker = pair.reader._owner.submit(release.wait)
    posted = pair.reader.post_read(pair.local, np.array([3]), pair.remote, np.array([32]), b"b")
    assert not posted.done()
    release.set()
    await asyncio.wrap_future(blocker)
    queued = await posted
    while await pair.reader.state(queued) == "PROC":
        await pair.source.get_new_notifs()
    assert threads[-1] == owner
    assert torch.equal(pair.reader_cache.blocks(0)[[3]], pair.source_cache.blocks(0)[[32]])
    # Above the inline limit: the owner thread copies, the loop stays free.
    monkeypatch.setattr(agent_module, "INLINE_MAX_BYTES", 4096)
    assert await read([4, 5], [33, 34], b"c") is False
    assert threads[-1] == owner
    assert pair.reader.live_xfers == 0
