"""Fixtures for the two-process transport tests (target subprocesses, an initiator rank)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest_asyncio

from tests.integration.transport import harness


@pytest_asyncio.fixture
async def spawn_target() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Start target rank processes (options become command-line flags); killed at teardown."""
    started: list[Any] = []

    async def spawn(**options: Any) -> Any:
        target = await harness.Target.spawn(**options)
        started.append(target)
        return target

    yield spawn
    for target in started:
        target.kill()


@pytest_asyncio.fixture
async def make_initiator() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Initiator ranks in this process (agent, registered cache, poller); closed at teardown."""
    made: list[Any] = []

    async def make(num_blocks: int = 256, page_bytes: int = 4096) -> Any:
        initiator = await harness.Initiator.make(num_blocks, page_bytes)
        made.append(initiator)
        return initiator

    yield make
    for initiator in made:
        await initiator.close()
