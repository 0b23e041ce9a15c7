"""`within`: a time limit that never loses a cancel. The cancel is made to come in the same turn
of the loop as the awaited result, the case where Python 3.11's `asyncio.wait_for` returns the
result and drops the cancel (shown here as the control, where it does)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

import pytest

from shared.timeouts import within

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]

Limit = Callable[[Awaitable[str], float], Awaitable[str]]


async def _cancelled_as_it_ends(limit: Limit) -> bool:
    """Whether a task awaiting `limit(result, ...)` ends cancelled when the result comes and the
    task is cancelled in the same turn of the loop."""
    result: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def waiter() -> str:
        await limit(result, 30)
        return "went on as if not cancelled"

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0.01)  # the task waits on the result
    result.set_result("ended")
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


async def test_a_cancel_as_the_wait_ends_still_cancels() -> None:
    assert await _cancelled_as_it_ends(within)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps the cancel from Python 3.12 on")
async def test_control_wait_for_drops_that_cancel() -> None:
    assert not await _cancelled_as_it_ends(asyncio.wait_for)


async def test_it_times_out_and_passes_results_on() -> None:
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0.01)
    assert await within(asyncio.sleep(0, "done"), 1) == "done"
    assert await within(asyncio.sleep(0, "no limit"), None) == "no limit"
