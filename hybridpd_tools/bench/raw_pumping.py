"""How the raw NIXL baseline progresses UCX on both sides while one of its READs is in flight.

Without NIXL's progress thread, UCX moves only inside NIXL calls. Over TCP a READ is emulated
with messages: the reader's `check_xfer_state()` receives the bytes, the target's
`get_new_notifs()` answers the request and sends them, so both sides' progress bounds the READ.
(Over cma, on one host, `transfer()` copies everything itself and neither side's pumping matters.)

A plain NIXL program can pump in several sensible ways, and which one is fastest depends on the
machine: with spare cores a tight loop wins, on a few shared cores it starves the TCP stack and
the other process, and a pause wins. So the baseline is measured under each strategy in the same
run and the fastest counts (see transfer.py). Each is used on both sides, the target's pumping
lasting from just before the READ is posted until its notification arrives:

- `spin`: call NIXL again at once (a tight loop, what nixlbench-style programs do);
- `spin-yield`: the same, giving the CPU to whoever waits for it between calls (sched_yield);
- `sleep-1ms`: sleep 1 ms between calls: the cadence of our own services' owner threads while
  a READ is tracked or its notification awaited (shared/transport/agent.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SLEEP_SECONDS = 0.001


def _spin() -> None:
    return None


def _sleep() -> None:
    time.sleep(SLEEP_SECONDS)


PAUSES: dict[str, Callable[[], None]] = {"spin": _spin, "spin-yield": os.sched_yield, "sleep-1ms": _sleep}
ACROSS_HOSTS = ("spin", "spin-yield", "sleep-1ms")
# On one host (cma) pumping cannot speed a READ up; a spinning target would only take CPU
# from the copy, so the 1 ms pause the raw target always used there.
ONE_HOST = ("sleep-1ms",)


def pause(name: str) -> Callable[[], None]:
    """The pause between two NIXL calls of strategy `name`."""
    try:
        return PAUSES[name]
    except KeyError:
        raise ValueError(f"unknown raw NIXL pumping {name!r}: one of {', '.join(PAUSES)}") from None
