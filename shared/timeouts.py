"""Awaiting with a time limit, without losing a cancel.

`asyncio.wait_for` on Python 3.11 returns the awaited result when a cancel comes in the same turn
of the loop as that result, and the cancel is gone: a cancelled request would go on as if never
cancelled (waiting for blocks, taking a credit). `within` raises the cancel whatever else happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """`await aw`, raising TimeoutError after `timeout` seconds (None: no limit)."""
    async with asyncio.timeout(None if timeout is None else max(0.0, timeout)):
        return await aw
