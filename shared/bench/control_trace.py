"""`bench control --breakdown`: where one request's control-plane time goes, step by step.

Instrumentation, not production code: for one extra pass of requests, StepTrace wraps the
functions a request passes through in the two in-process services (and only those instances)
with a timestamp each, then restores them. Steps are the time between two named marks of the
same request. The pass is separate from the untraced one whose phases `bench control` reports,
because each mark costs a few microseconds.

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

from shared.bench.stats import Summary

NOTIFICATION_WAIT_STEP = "prefill: READ done -> pump fetched the notification"

# (label, from mark, to mark). Marks prefixed d. run on decode's loop, p. on prefill's loop,
# o. on an agent's owner thread, c. on prefill's compute thread.
STEPS: tuple[tuple[str, str, str], ...] = (
    ("job over the Session stream (decode -> prefill)", "d.job_queued", "p.job_received"),
    ("prefill: job task starts, credit taken", "p.job_received", "p.job_started"),
    ("prefill: prompt checks + block allocation", "p.job_started", "p.allocated"),
    ("prefill: hop to the compute thread", "p.allocated", "c.compute"),
    ("prefill: engine call (none) + hop back", "c.compute", "p.computed"),
    ("prefill: pin (notification waits armed)", "p.computed", "p.pinned"),
    ("prefill: manifest built", "p.pinned", "p.manifest_built"),
    ("manifest over the Session stream (prefill -> decode)", "p.manifest_built", "d.manifest_received"),
    ("decode: manifest checks + descriptor ids", "d.read_start", "d.ids"),
    ("decode: bytes by section", "d.ids", "d.bytes"),
    ("decode: to the post (inline on the loop when small)", "d.bytes", "o.post_start"),
    ("decode: make_prepped_xfer + transfer (the copy)", "o.post_start", "o.post_end"),
    ("decode: READ done -> back on the event loop", "o.post_end", "d.read_end"),
    (NOTIFICATION_WAIT_STEP, "o.post_end", "o.notif_fetched"),
    ("prefill: notification -> event loop", "o.notif_fetched", "p.notif_dispatched"),
    ("prefill: pin ended, blocks freed", "p.notif_dispatched", "p.freed"),
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


def _wrap_after(trace: StepTrace, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        trace.mark(name)
        return result

    return wrapper


def _wrap_before(trace: StepTrace, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        trace.mark(name)
        return fn(*args, **kwargs)

    return wrapper


def _wrap_async(trace: StepTrace, before: str | None, after: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before:
            trace.mark(before)
        result = await fn(*args, **kwargs)
        if after:
            trace.mark(after)
        return result

    return wrapper


@contextmanager
def traced(trace: StepTrace, prefill_app: Any, decode_app: Any) -> Iterator[None]:
    """Wrap the request path of these two service instances; everything is restored on exit."""
    import decode_svc.reader as reader
    from decode_svc.session_client import SessionClient
    from prefill_svc.session import PrefillSession

    restore: list[tuple[Any, str, Any, bool]] = []  # (owner, attribute, old value, was an instance attribute)

    def patch(owner: Any, attr: str, new: Any) -> None:
        restore.append((owner, attr, getattr(owner, attr), attr in vars(owner)))
        setattr(owner, attr, new)

    send, resolve, start_job = SessionClient._send, SessionClient._resolve, PrefillSession._start_job

    def traced_send(self: SessionClient, msg: Any) -> None:
        if msg.WhichOneof("payload") == "job":
            trace.mark("d.job_queued")
        send(self, msg)

    patch(SessionClient, "_send", traced_send)
    patch(SessionClient, "_resolve", _wrap_before(trace, "d.manifest_received", resolve))
    patch(PrefillSession, "_start_job", _wrap_before(trace, "p.job_received", start_job))
    runner = prefill_app.servicer.runner
    patch(runner, "run", _wrap_async(trace, "p.job_started", "p.manifest_built", runner.run))
    host = prefill_app.host
    patch(host, "allocate_queued", _wrap_async(trace, None, "p.allocated", host.allocate_queued))
    run_compute = host.run_compute

    async def traced_compute(fn: Callable[[], Any]) -> Any:
        result = await run_compute(_wrap_before(trace, "c.compute", fn))
        trace.mark("p.computed")
        return result

    patch(host, "run_compute", traced_compute)
    pins = prefill_app.pins
    patch(pins, "pin", _wrap_after(trace, "p.pinned", pins.pin))
    patch(pins, "release", _wrap_after(trace, "p.freed", pins.release))
    router = host.poller.router
    patch(router, "dispatch", _wrap_before(trace, "p.notif_dispatched", router.dispatch))
    for agent in host.agents:  # the sink the owner thread calls with fetched notifications
        patch(agent, "_sink", _wrap_before(trace, "o.notif_fetched", agent._sink))
    patch(reader, "read_indices", _wrap_after(trace, "d.ids", reader.read_indices))
    patch(reader, "_pair_bytes", _wrap_after(trace, "d.bytes", reader._pair_bytes))
    for agent in decode_app.host.agents:
        post = agent._post_read
        patch(agent, "_post_read", _wrap_after(trace, "o.post_end", _wrap_before(trace, "o.post_start", post)))
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
