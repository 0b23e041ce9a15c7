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
import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import decode_svc.reader as reader
from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from prefill_svc.session import PrefillSession
from shared import tracing
from shared.bench.stats import Summary
from shared.layout.read_lists import read_indices
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
        return [
            {"step": label, **Summary.of(samples).scaled(1e3).as_dict()} for label, samples in self.step_samples().items()
        ]


@contextmanager
def traced(trace: StepTrace, prefill_app: PrefillApp, decode_app: DecodeApp) -> Iterator[None]:
    """Every mark of both services goes to `trace` until the block exits."""
    with tracing.tracing_into(trace), _interim_marks(prefill_app, decode_app):
        yield


# Interim: the steps below are marked in files being reworked on the data-path branch; until
# those files call `tracing.mark` themselves, these wrappers make the calls for them, on these
# two service instances only, and restore everything on exit. Each entry names the step and
# the function whose call it brackets; delete an entry once its file marks the step.
def _mark_after(step: Step, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        tracing.mark(step)
        return result

    return wrapper


def _mark_before(step: Step, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tracing.mark(step)
        return fn(*args, **kwargs)

    return wrapper


def _mark_around_async(before: Step | None, after: Step | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            tracing.mark(before)
        result = await fn(*args, **kwargs)
        if after is not None:
            tracing.mark(after)
        return result

    return wrapper


@contextmanager
def _interim_marks(prefill_app: PrefillApp, decode_app: DecodeApp) -> Iterator[None]:
    restore: list[tuple[Any, str, Any, bool]] = []  # (owner, attribute, old value, was an instance attribute)

    def patch(owner: Any, attr: str, new: Any) -> None:
        restore.append((owner, attr, getattr(owner, attr), attr in vars(owner)))
        setattr(owner, attr, new)

    patch(PrefillSession, "_start_job", _mark_before(Step.JOB_RECEIVED, PrefillSession._start_job))
    runner = prefill_app.servicer.runner
    patch(runner, "run", _mark_around_async(Step.JOB_STARTED, Step.MANIFEST_BUILT, runner.run))
    host = prefill_app.host
    patch(host, "allocate_queued", _mark_around_async(None, Step.ALLOCATED, host.allocate_queued))
    run_compute = host.run_compute

    async def traced_compute(fn: Callable[[], Any]) -> Any:
        result = await run_compute(_mark_before(Step.COMPUTE, fn))
        tracing.mark(Step.COMPUTED)
        return result

    patch(host, "run_compute", traced_compute)
    router = host.poller.router
    patch(router, "dispatch", _mark_before(Step.NOTIFICATION_DISPATCHED, router.dispatch))
    for agent in host.agents:  # the sink the owner thread calls with fetched notifications
        if agent._sink is not None:
            patch(agent, "_sink", _mark_before(Step.NOTIFICATION_FETCHED, agent._sink))
    patch(reader, "read_indices", _mark_after(Step.IDS, read_indices))  # the module-level name reader.py calls
    patch(reader, "_pair_bytes", _mark_after(Step.BYTES, reader._pair_bytes))
    for agent in decode_app.host.agents:
        post = agent._post_read
        patch(agent, "_post_read", _mark_after(Step.POST_END, _mark_before(Step.POST_START, post)))
    try:
        yield
    finally:
        for owner, attr, old, was_instance in reversed(restore):
            if was_instance:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)  # an instance shadowed its class's method: unshadow it


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
