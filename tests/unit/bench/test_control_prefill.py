"""The pin-end record of `bench control --separate-processes`'s prefill process."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybridpd_tools.bench.control_prefill import PinEnds


@pytest.mark.asyncio
async def test_a_pin_end_is_answered_whether_asked_before_or_after_it_happened() -> None:
    ends = PinEnds()
    before = time.perf_counter()
    ends.ended("early", "read")
    assert (await ends.wait("early"))[1] == "read"
    waiting = asyncio.ensure_future(ends.wait("late"))
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing ended yet: a wait cannot answer early
    ends.ended("late", "lease_expired")
    ended_at, reason = await asyncio.wait_for(waiting, 1)
    assert reason == "lease_expired" and before <= ended_at <= time.perf_counter()
    # Answered once: the record is dropped, so a long benchmark does not accumulate them.
    assert ends._ended == {}
