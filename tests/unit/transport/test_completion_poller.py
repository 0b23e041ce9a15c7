"""The completion poller driving real READs between two agents of this process.

A source agent nobody pumps never answers connection wire-up, so a first READ
from it stays in flight: a real stand-in for a frozen peer, used for deadlines,
cancellation and closing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from shared.transport.errors import TransferTimedOut, TransportError
from shared.transport.poller import CompletionPoller

pytestmark = pytest.mark.timeout(30)


async def eventually(condition: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        await asyncio.sleep(0.005)
    assert condition()


@pytest.mark.asyncio
async def test_one_poller_drives_the_read_and_delivers_its_notification(pair: Any) -> None:
    poller = CompletionPoller()
    try:
        poller.attach(pair.source)
        freed = poller.expect(pair.source, b"req-1", 1)
        ids = np.arange(8, 24)
        result = await poller.read(pair.reader, pair.local, ids, pair.remote, ids[::-1], b"req-1", timeout=5)
        assert result.nbytes == 16 * pair.reader_cache.page_bytes and result.peer == pair.source.name
        assert torch.equal(pair.reader_cache.blocks(0)[ids], pair.source_cache.blocks(0)[ids[::-1].copy()])
        assert await asyncio.wait_for(freed, 5) == [pair.reader.name]
        stats = poller.stats
        assert (stats.reads_posted, stats.reads_done, stats.bytes_read) == (1, 1, result.nbytes)
        assert poller.in_flight == 0
        # A READ done inside its post is released by the owner thread right after the caller
        # got the result (RankAgent.post_read), so the release may still be on its way here.
        await eventually(lambda: pair.reader.live_xfers == 0)
    finally:
        await poller.aclose()


@pytest.mark.asyncio
async def test_a_read_that_cannot_finish_ends_at_its_deadline_and_the_peer_recovers(pair: Any) -> None:
    poller = CompletionPoller()
    try:
        with pytest.raises(TransferTimedOut, match=pair.source.name) as timed_out:
            await poller.read(pair.reader, pair.local, [0], pair.remote, [0], b"stuck", timeout=0.3)
        assert timed_out.value.peer == pair.source.name
        await eventually(lambda: pair.reader.live_xfers == 0)
        assert poller.stats.reads_timed_out == 1 and poller.in_flight == 0

        poller.attach(pair.source)  # the source progresses again
        await poller.read(pair.reader, pair.local, [1], pair.remote, [1], b"ok", timeout=5)
        assert torch.equal(pair.reader_cache.blocks(0)[1], pair.source_cache.blocks(0)[1])
    finally:
        await poller.aclose()


@pytest.mark.asyncio
async def test_cancelling_a_read_in_flight_releases_its_handle(pair: Any) -> None:
    poller = CompletionPoller()
    try:
        reading = asyncio.ensure_future(poller.read(pair.reader, pair.local, [0], pair.remote, [0], b"x", timeout=30))
        await eventually(lambda: poller.in_flight == 1)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await eventually(lambda: pair.reader.live_xfers == 0)
        assert poller.in_flight == 0 and poller.stats.reads_cancelled == 1 and poller.stats.reads_posted == 1
    finally:
        await poller.aclose()


@pytest.mark.asyncio
async def test_cancelling_a_read_while_it_is_posted_releases_its_handle(pair: Any) -> None:
    poller = CompletionPoller()
    poller.attach(pair.reader)
    release = threading.Event()
    blocker = pair.reader._owner.submit(release.wait)  # the post queues behind this job
    try:
        reading = asyncio.ensure_future(poller.read(pair.reader, pair.local, [0], pair.remote, [0], b"x", timeout=30))
        await asyncio.sleep(0.05)  # the post is queued on the owner thread, not run yet
        assert not reading.done()
        reading.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await eventually(lambda: pair.reader.live_xfers == 0 and not poller._drops)
        assert poller.stats.reads_cancelled == 1 and poller.stats.reads_posted == 0
    finally:
        release.set()
        blocker.result(timeout=5)
        await poller.aclose()


@pytest.mark.asyncio
async def test_closing_the_poller_fails_reads_in_flight(pair: Any) -> None:
    poller = CompletionPoller()
    reading = asyncio.ensure_future(poller.read(pair.reader, pair.local, [0], pair.remote, [0], b"x", timeout=30))
    await eventually(lambda: poller.in_flight == 1)
    await poller.aclose()
    with pytest.raises(TransportError, match="closed"):
        await reading
    await eventually(lambda: pair.reader.live_xfers == 0)
    with pytest.raises(RuntimeError, match="closed"):
        poller.attach(pair.reader)


@pytest.mark.asyncio
async def test_notifications_nobody_awaits_are_counted_and_reported(pair: Any) -> None:
    seen: list[tuple[str, str, bytes]] = []
    poller = CompletionPoller(on_unknown_notif=lambda *args: seen.append(args))
    try:
        poller.attach(pair.source)
        poller.attach(pair.reader)  # its pump carries the send through wire-up
        await pair.reader.send_notif(pair.source.name, b"stray")
        await eventually(lambda: poller.stats.notifs_unknown == 1)
        assert seen == [(pair.source.name, pair.reader.name, b"stray")]
    finally:
        await poller.aclose()


@pytest.mark.asyncio
async def test_an_idle_agent_backs_off_yet_sees_notifications_and_awaited_ones_are_pumped_at_once(pair: Any) -> None:
    seen: list[bytes] = []
    poller = CompletionPoller(idle_interval=0.002, on_unknown_notif=lambda _, __, msg: seen.append(msg))
    try:
        poller.attach(pair.source)
        poller.attach(pair.reader)
        # Nothing to do: the source's pumps find nothing and their waits grow past the idle rate.
        await eventually(lambda: (pair.source._owner.pump_wait or 0) >= 8 * poller.idle_interval)
        # A message nobody awaits still arrives while backed off (within MAX_IDLE_WAIT).
        await pair.reader.send_notif(pair.source.name, b"stray")
        await eventually(lambda: seen == [b"stray"])
        # Awaiting notifications is a call on the agent: from then on it is pumped at the busy rate.
        freed = poller.expect(pair.source, b"z", 1)
        wait = await asyncio.wrap_future(pair.source._owner.submit(lambda: pair.source._owner.pump_wait))
        assert wait == poller.busy_interval
        await poller.read(pair.reader, pair.local, [3], pair.remote, [3], b"z", timeout=5)
        assert await asyncio.wait_for(freed, 5) == [pair.reader.name]
    finally:
        await poller.aclose()


@pytest.mark.asyncio
async def test_an_idle_poller_without_idle_pumping_parks(pair: Any) -> None:
    poller = CompletionPoller(idle_interval=None)
    try:
        freed = poller.expect(pair.source, b"y", 1)  # keeps the source pumped until then
        await poller.read(pair.reader, pair.local, [2], pair.remote, [2], b"y", timeout=5)
        await asyncio.wait_for(freed, 5)
        await asyncio.sleep(0.01)
        pumps = pair.source.pumps, pair.reader.pumps
        await asyncio.sleep(0.1)
        assert (pair.source.pumps, pair.reader.pumps) == pumps
    finally:
        await poller.aclose()


def test_sub_millisecond_busy_polling_is_refused() -> None:
    with pytest.raises(ValueError, match="busy spin"):
        CompletionPoller(busy_interval=0.0001)
