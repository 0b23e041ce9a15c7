"""The design floor of `bench control --breakdown` when the notification is fetched before
decode's post returns: the notification wait's two marks lie on two services' threads with no
order between them, so its median can be below 0, and the floor counts that wait as 0."""

from __future__ import annotations

import pytest

from hybridpd_tools.bench.control import _breakdown
from hybridpd_tools.bench.control_trace import Mark, StepTrace
from shared.observe import Step


def _trace(post_end: float, fetched: float) -> StepTrace:
    trace = StepTrace()
    trace.requests.append(
        {
            Step.POST_END: [Mark(post_end, None, None)],
            Step.NOTIFICATION_FETCHED: [Mark(fetched, None, None)],
        }
    )
    return trace


PHASES = {"echo": {"median": 1.0}, "raw_read": {"median": 0.5}}


def test_a_notification_fetched_before_the_post_returned_waits_zero() -> None:
    floor = _breakdown(_trace(post_end=10.002, fetched=10.001), PHASES, hop_ms=0.25)
    assert floor["floors"]["notification_wait_ms"] == 0.0
    assert floor["design_floor_ms"] == pytest.approx(1.75)


def test_a_notification_fetched_after_the_post_counts_its_wait() -> None:
    """The control: a real wait of 2 ms is in the floor."""
    floor = _breakdown(_trace(post_end=10.000, fetched=10.002), PHASES, hop_ms=0.25)
    assert floor["floors"]["notification_wait_ms"] == pytest.approx(2.0)
    assert floor["design_floor_ms"] == pytest.approx(3.75)
