"""`bench control --breakdown`: where one request's control-plane time goes, step by step.

The services mark named steps through `shared.tracing` (a no-op unless a sink is installed);
for one extra pass of requests StepTrace is installed as the sink and stamps each mark. Steps
are the time between two named marks of the same request. The pass is separate from the
untraced one whose phases `bench control` reports, because each stamp costs a few microseconds.

The floors measured beside it (in control.py, from the same run) are what no implementation of
this design can avoid on this machine: a Session stream round trip (echo), a hop from the event loop to a
worker thread and back (the compute thread; a READ this small is posted on the event loop
itself, without the hop to the agent's owner thread), the raw READ, and prefill's wait for the
notification (the owner thread pumps the agent every 1 ms while notifications are awaited, so a
READ's notification waits for the next pump; taken from the traced pass).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from shared import tracing
from shared.bench.stats import Summary
from shared.tracing import Step

NOTIFICATION_WAIT_STEP = "prefill: READ done -> pump fetched the notification"

# (label, from step, to step); the step names say on which thread each mark runs (shared/tracing.py).
STEPS: tuple[tuple[str, Step, Step], ...] = (
    ("job over the Session stream (decode -> prefill)", Step.JOB_QUEUED, Step.JOB_RECEIVED),
    ("prefill: job task starts, credit taken", Step.JOB_RECEIVED, Step.JOB_STARTED),
    ("prefill: prompt checks + block allocation", Step.JOB_STARTED, Step.ALLOCATED),
    ("prefill: hop to the compute thread", Step.ALLOCATED, Step.COMPUTE),
    ("prefill: engine call (none) + hop back", Step.COMPUTE, Step.COMPUTED),
    ("prefill: pin (notification waits armed)", Step.COMPUTED, Step.PINNED),
    ("prefill: manifest built", Step.PINNED, Step.MANIFEST_BUILT),
    ("manifest over the Session stream (prefill -> decode)", Step.MANIFEST_BUILT, Step.MANIFEST_RECEIVED),
    ("decode: manifest checks + descriptor ids", Step.READ_START, Step.IDS),
    ("decode: bytes by section", Step.IDS, Step.BYTES),
    ("decode: to the post (inline on the loop when small)", Step.BYTES, Step.POST_START),
    ("decode: make_prepped_xfer + transfer (the copy)", Step.POST_START, Step.POST_END),
    ("decode: READ done -> back on the event loop", Step.POST_END, Step.READ_END),
    (NOTIFICATION_WAIT_STEP, Step.POST_END, Step.NOTIFICATION_FETCHED),
    ("prefill: notification -> event loop", Step.NOTIFICATION_FETCHED, Step.NOTIFICATION_DISPATCHED),
    ("prefill: pin ended, blocks freed", Step.NOTIFICATION_DISPATCHED, Step.FREED),
)


@dataclass
class StepTrace:
    """Timestamps per request: `begin(request)` starts a request, `mark(name)` stamps it."""

    requests: list[dict[str, list[float]]] = field(default_factory=list)
    _current: dict[str, list[float]] | None = None

    def begin(self) -> None:
        self._current = {}
        self.requests.append(self._current)

    def end(self) -> None:
        self._current = None

    def mark(self, name: str) -> None:
        if self._current is not None:
            self._current.setdefault(name, []).append(time.perf_counter())

    def step_samples(self) -> dict[str, list[float]]:
        """Seconds per step and request: first `from` mark to the last `to` mark (all ranks)."""
        out: dict[str, list[float]] = {label: [] for label, _, _ in STEPS}
        for marks in self.requests:
            for label, start, stop in STEPS:
                if start in marks and stop in marks:
                    out[label].append(max(marks[stop]) - min(marks[start]))
        return out

    def summaries_ms(self) -> list[dict[str, Any]]:
        return [{"step": label, **Summary.of(samples).scaled(1e3).as_dict()} for label, samples in self.step_samples().items()]


@contextmanager
def traced(trace: StepTrace) -> Iterator[None]:
    """Every mark of both services goes to `trace` until the block exits."""
    with tracing.tracing_into(trace):
        yield


async def thread_hop_seconds(count: int) -> list[float]:
    """Event loop -> a worker thread (doing nothing) -> event loop, `count` times."""
    loop = asyncio.get_running_loop()
    times: list[float] = []
    with ThreadPoolExecutor(1, thread_name_prefix="bench-hop") as pool:
        for _ in range(count):
            started = time.perf_counter()
            await loop.run_in_executor(pool, _nothing)
            times.append(time.perf_counter() - started)
    return times


def _nothing() -> None:
    return None
