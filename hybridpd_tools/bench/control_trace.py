"""`bench control --breakdown`: where one request's control-plane time goes, step by step.

The services mark named steps through `shared.observe` (a no-op unless a sink is installed);
for one extra pass of requests StepTrace is installed as the sink and stamps each mark. Steps
are the time between two named marks of the same request. The pass is separate from the
untraced one whose phases `bench control` reports, because each stamp costs a few microseconds.

A mark made on the event loop's thread also reads that thread's CPU time (`time.thread_time`):
a step whose marks all lie on the loop gets its loop CPU, the work the loop did between them
whichever service did it (in this process both services share one loop). With a CallCounter
counting the loop thread's function calls (`--calls`, one more pass: counting slows every call),
such a step also gets its exact number of Python and C calls. The counts include the marks' own
few calls, the same at every commit.

The floors measured beside it (in control.py, from the same run) are what no implementation of
this design can avoid on this machine: a Session stream round trip (echo), a hop from the event loop to a
worker thread and back (the compute thread; a READ this small is posted on the event loop
itself, without the hop to the agent's owner thread), the raw READ, and prefill's wait for the
notification (the owner thread pumps the agent every 1 ms while notifications are awaited, so a
READ's notification waits for the next pump; taken from the traced pass).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NamedTuple

from hybridpd_tools.bench.stats import Summary, json_number, percentile
from shared import observe
from shared.observe import Step

NOTIFICATION_WAIT_STEP = "prefill: READ done -> pump fetched the notification"

# (label, from step, to step); the step names say on which thread each mark runs (shared/observe.py).
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


class Mark(NamedTuple):
    wall: float  # time.perf_counter()
    loop_cpu: float | None  # the loop thread's time.thread_time(); None when marked on another thread
    calls: tuple[int, int] | None  # (Python, C) calls counted on the loop thread so far; None without a counter


class CallCounter:
    """Counts the function calls of the thread that runs `counting()` (sys.setprofile is per thread)."""

    def __init__(self) -> None:
        self.python = 0  # Python frames started or resumed (a coroutine's resumption counts, as in cProfile)
        self.c = 0  # calls of C functions (builtins, extension methods)

    def _event(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            self.python += 1
        elif event == "c_call":
            self.c += 1

    @contextmanager
    def counting(self) -> Iterator[None]:
        previous = sys.getprofile()
        sys.setprofile(self._event)
        try:
            yield
        finally:
            sys.setprofile(previous)


@dataclass
class StepTrace:
    """Marks per request: `begin()` starts a request, `mark(name)` stamps it. `loop_thread` is the
    event loop's thread (by default the one that makes the trace); `counter`, when given, counts
    that thread's calls."""

    loop_thread: int = field(default_factory=threading.get_ident)
    counter: CallCounter | None = None
    requests: list[dict[str, list[Mark]]] = field(default_factory=list)
    _current: dict[str, list[Mark]] | None = None

    def begin(self) -> None:
        self._current = {}
        self.requests.append(self._current)

    def end(self) -> None:
        self._current = None

    def mark(self, name: str) -> None:
        if self._current is None:
            return
        if threading.get_ident() != self.loop_thread:
            self._current.setdefault(name, []).append(Mark(time.perf_counter(), None, None))
            return
        counter = self.counter
        calls = None if counter is None else (counter.python, counter.c)
        self._current.setdefault(name, []).append(Mark(time.perf_counter(), time.thread_time(), calls))

    def step_samples(self) -> dict[str, list[float]]:
        """Seconds per step and request: first `from` mark to the last `to` mark (all ranks)."""
        out: dict[str, list[float]] = {label: [] for label, _, _ in STEPS}
        for marks in self.requests:
            for label, start, stop in STEPS:
                if start in marks and stop in marks:
                    out[label].append(max(m.wall for m in marks[stop]) - min(m.wall for m in marks[start]))
        return out

    def loop_cpu_samples(self) -> dict[str, list[float]]:
        """The loop thread's CPU seconds per step and request, for steps whose marks all lie on it."""
        out: dict[str, list[float]] = {label: [] for label, _, _ in STEPS}
        for marks in self.requests:
            for label, first, last in _loop_ends(marks):
                if first.loop_cpu is not None and last.loop_cpu is not None:
                    out[label].append(last.loop_cpu - first.loop_cpu)
        return out

    def call_samples(self) -> dict[str, list[tuple[int, int]]]:
        """(Python, C) calls on the loop thread per step and request (traced with a counter)."""
        out: dict[str, list[tuple[int, int]]] = {label: [] for label, _, _ in STEPS}
        for marks in self.requests:
            for label, first, last in _loop_ends(marks):
                if first.calls is not None and last.calls is not None:
                    out[label].append((last.calls[0] - first.calls[0], last.calls[1] - first.calls[1]))
        return out

    def summaries_ms(self) -> list[dict[str, Any]]:
        """Per step: the wall-clock summary in ms and, for steps on the loop, its loop CPU in µs."""
        cpu = self.loop_cpu_samples()
        return [
            {"step": label, **Summary.of(samples).scaled(1e3).as_dict(), "loop_cpu_us": cpu_summary_us(cpu[label])}
            for label, samples in self.step_samples().items()
        ]

    def call_summaries(self) -> list[dict[str, Any]]:
        return [{"step": label, **call_summary(samples)} for label, samples in self.call_samples().items()]


def _loop_ends(marks: dict[str, list[Mark]]) -> Iterator[tuple[str, Mark, Mark]]:
    """(label, first `from` mark, last `to` mark) of each step marked only on the loop thread."""
    for label, start, stop in STEPS:
        starts, stops = marks.get(start), marks.get(stop)
        if starts and stops and all(m.loop_cpu is not None for m in (*starts, *stops)):
            yield label, min(starts, key=lambda m: m.wall), max(stops, key=lambda m: m.wall)


def cpu_summary_us(seconds: Sequence[float]) -> dict[str, Any]:
    """p10 and median of CPU seconds, in µs (the p10: the least disturbed by other load)."""
    return {
        "count": len(seconds),
        "p10": json_number(percentile(seconds, 10) * 1e6),
        "median": json_number(percentile(seconds, 50) * 1e6),
    }


def call_summary(samples: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Mean and median Python and C calls per sample (None when there are none)."""
    python, c = [p for p, _ in samples], [k for _, k in samples]
    return {
        "count": len(samples),
        "python_mean": round(statistics.fmean(python), 1) if samples else None,
        "python_median": statistics.median(python) if samples else None,
        "c_mean": round(statistics.fmean(c), 1) if samples else None,
        "c_median": statistics.median(c) if samples else None,
    }


@contextmanager
def traced(trace: StepTrace) -> Iterator[None]:
    """Every mark of both services goes to `trace` until the block exits."""
    with observe.tracing_into(trace):
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
