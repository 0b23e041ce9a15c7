"""The loopback self-READ each rank does before its service calls itself ready."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
import torch

from shared.cache.regions import RankCache
from shared.errors import Unavailable
from shared.transport.agent import RankAgent
from shared.transport.loopback import LOOPBACK_BYTES, loopback_read
from shared.transport.poller import CompletionPoller, ReadResult

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_loopback_read_moves_bytes_and_leaves_the_cache_zeroed() -> None:
    agent = await RankAgent.create("loopback-test", 0)
    poller = CompletionPoller()
    cache = RankCache(2, 4, 8192)
    try:
        await cache.register(agent)
        poller.attach(agent)
        assert await loopback_read(agent, cache, poller) == LOOPBACK_BYTES
        assert poller.stats.notifs_received == 1  # the notification path works too
        assert all(int(region.count_nonzero()) == 0 for region in cache.regions)
    finally:
        await poller.aclose()
        await agent.aclose()


async def test_loopback_read_fails_on_memory_the_agent_does_not_know() -> None:
    """Negative control: memory that was never registered cannot be read, and the check says so."""
    agent = await RankAgent.create("loopback-test", 0)
    poller = CompletionPoller()
    registered, stranger = RankCache(1, 4, 8192), RankCache(1, 4, 8192)
    try:
        await registered.register(agent)
        poller.attach(agent)
        with pytest.raises(Unavailable) as err:
            await loopback_read(agent, stranger, poller)
        assert err.value.reason == "LOOPBACK_FAILED" and agent.name in err.value.message
        assert torch.count_nonzero(stranger.regions[0]) == 0
    finally:
        await poller.aclose()
        await agent.aclose()


async def test_a_notification_that_never_arrives_is_reported_with_the_pump_count() -> None:
    """Negative control for the notification half: the agent's pump stops fetching notifications
    before the READ is posted (a FAKE of a pump that went quiet), so its notification never arrives."""
    agent = await RankAgent.create("loopback-test", 0)
    poller = CompletionPoller()
    cache = RankCache(1, 4, 8192)
    real_read = poller.read

    async def stop_pumping_then_read(*args: Any, **kwargs: Any) -> ReadResult:
        await asyncio.wrap_future(agent.stop_pump())  # READs in flight are still polled, notifications not
        return await real_read(*args, **kwargs)

    try:
        await cache.register(agent)
        poller.attach(agent)
        poller.read = stop_pumping_then_read  # type: ignore[method-assign]
        with pytest.raises(Unavailable) as err:
            await loopback_read(agent, cache, poller, timeout=0.5)
        assert err.value.reason == "LOOPBACK_FAILED"
        assert "notification did not arrive within 0.5 s" in err.value.message
        assert re.search(r"the agent was pumped \d+ times", err.value.message)
        assert all(int(region.count_nonzero()) == 0 for region in cache.regions)
    finally:
        await poller.aclose()
        await agent.aclose()
