"""Waiting in a test for something the services do on their own time."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable


async def until(condition: Callable[[], object], what: str = "the condition", timeout: float = 5.0, every: float = 0.01) -> None:
    """Return once `condition()` is true (a coroutine's result is awaited), asking every `every`
    seconds; fail the test, naming `what`, when `timeout` seconds pass first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        assert loop.time() < deadline, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(every)
