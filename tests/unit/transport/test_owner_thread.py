"""The owner thread's pump schedule: full rate while there is work, backed off while idle.

The pump here is a plain function that records the wait it was scheduled with; the schedule is
checked as a sequence of waits, never as a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from shared.transport.owner_thread import OwnerThread

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """A pump that records `pump_wait` at each call and says it found work while `busy`."""

    def __init__(self, pumps_wanted: int) -> None:
        self.owner: OwnerThread | None = None
        self.waits: list[float | None] = []
        self.busy = 0  # the next `busy` pumps find work
        self.done = threading.Event()
        self.pumps_wanted = pumps_wanted

    def pump(self) -> bool:
        assert self.owner is not None
        self.waits.append(self.owner.pump_wait)
        if len(self.waits) >= self.pumps_wanted:
            self.done.set()
        if self.busy:
            self.busy -= 1
            return True
        return False


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder(pumps_wanted=8)
    rec.owner = OwnerThread("owner-test", rec.pump, lambda: 0.001, max_idle_wait=0.016)
    yield rec
    rec.owner.stop()


def test_idle_pumps_back_off_to_the_bound_and_a_call_restores_the_full_rate(recorder: Recorder) -> None:
    assert recorder.done.wait(10)
    assert recorder.waits[:8] == [0.001, 0.002, 0.004, 0.008, 0.016, 0.016, 0.016, 0.016]
    owner = recorder.owner
    assert owner is not None
    # A call resets the schedule before it runs, so a call sees the full rate.
    assert owner.submit(lambda: owner.pump_wait).result() == 0.001


def test_a_pump_that_finds_work_keeps_the_full_rate() -> None:
    rec = Recorder(pumps_wanted=8)
    rec.busy = 5
    rec.owner = OwnerThread("owner-test", rec.pump, lambda: 0.001, max_idle_wait=0.016)
    try:
        assert rec.done.wait(10)
        assert rec.waits[:8] == [0.001] * 6 + [0.002, 0.004]
    finally:
        rec.owner.stop()


def test_without_an_interval_the_owner_never_pumps() -> None:
    rec = Recorder(pumps_wanted=1)
    rec.owner = OwnerThread("owner-test", rec.pump, lambda: None)
    try:
        assert rec.owner.submit(lambda: 7).result() == 7
        assert rec.waits == []
    finally:
        rec.owner.stop()


def test_an_inline_call_wakes_an_owner_backed_off_to_a_long_wait() -> None:
    base = [0.001]
    woken = threading.Event()
    rec = Recorder(pumps_wanted=2)

    def interval() -> float:
        owner = rec.owner
        # The owner thread looks at its schedule again with the back-off reset: it was woken.
        on_owner = owner is not None and threading.current_thread() is owner.thread
        if on_owner and owner is not None and len(rec.waits) >= 2 and owner._idle_pumps == 0:
            woken.set()
        return base[0]

    def pump() -> bool:
        found = rec.pump()
        if len(rec.waits) == 2:
            base[0] = 1800.0  # from now on the owner waits an hour between pumps
        return found

    rec.owner = OwnerThread("owner-test", pump, interval, max_idle_wait=3600.0)
    try:
        assert rec.done.wait(10)
        while rec.owner.pump_wait != 3600.0:  # two idle pumps: backed off past twice its interval
            time.sleep(0.001)
        ran, result = False, None
        while not ran:  # the owner may still hold its lock right after the pump
            ran, result = rec.owner.try_inline(lambda: 5)
        assert result == 5
        assert woken.wait(10), "the owner thread slept on after the inline call"
        assert len(rec.waits) == 2  # woken to reschedule, not pumped early (its hour is not over)
    finally:
        rec.owner.stop()
