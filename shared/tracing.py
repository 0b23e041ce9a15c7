"""Named steps of one request, for benchmark tracing (`hybrid-pd bench control --breakdown`).

The services call `mark(Step.X)` where a request passes a step; nothing listens unless a
benchmark installs a sink with `tracing_into`, so in production a mark is one global read and
a comparison. The sink is process-wide, not per request: the traced benchmark pass runs one
request at a time through both services in one process, and a mark comes from whichever thread
reaches the step (the event loops, an agent's owner thread, prefill's compute thread).

Step names carry the place they run: `d.` decode's event loop, `p.` prefill's event loop,
`o.` an agent's owner thread, `c.` prefill's compute thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Protocol


class Step(StrEnum):
    """Every step a service marks. The comment is where the mark is made."""

    JOB_QUEUED = "d.job_queued"  # decode_svc/session_client.py: the job is queued for the Session stream
    JOB_RECEIVED = "p.job_received"  # prefill_svc/session.py: a job message arrived, before its task starts
    JOB_STARTED = "p.job_started"  # prefill_svc/jobs.py: the job task runs (credit taken)
    ALLOCATED = "p.allocated"  # shared/runtime/engine_host.py: queued block allocation returned
    COMPUTE = "c.compute"  # shared/runtime/engine_host.py: the compute function starts on the compute thread
    COMPUTED = "p.computed"  # shared/runtime/engine_host.py: back on the event loop after the compute
    PINNED = "p.pinned"  # prefill_svc/pins.py: the pin exists, notification waits armed
    MANIFEST_BUILT = "p.manifest_built"  # prefill_svc/jobs.py: the job returns its manifest
    MANIFEST_RECEIVED = "d.manifest_received"  # decode_svc/session_client.py: a manifest (or failure) resolves its job
    READ_START = "d.read_start"  # decode's READ of one request begins (the benchmark marks it around the read)
    IDS = "d.ids"  # decode_svc/reader.py: descriptor ids computed for one (decode rank, source rank)
    BYTES = "d.bytes"  # decode_svc/reader.py: bytes by section counted for that pair
    POST_START = "o.post_start"  # shared/transport/agent.py: on the owner thread (or inline), before posting
    POST_END = "o.post_end"  # shared/transport/agent.py: the posted READ completed
    READ_END = "d.read_end"  # decode's READ of one request done, back on the event loop
    NOTIFICATION_FETCHED = "o.notif_fetched"  # shared/transport/agent.py: the owner thread hands fetched notifications on
    NOTIFICATION_DISPATCHED = "p.notif_dispatched"  # shared/transport/notifications.py: the router dispatches them
    FREED = "p.freed"  # prefill_svc/pins.py: the pin ended and its blocks are free


class StepSink(Protocol):
    def mark(self, step: str) -> None: ...


_sink: StepSink | None = None


def mark(step: Step) -> None:
    """Record that the current request reached `step` (a no-op unless a sink is installed)."""
    sink = _sink
    if sink is not None:
        sink.mark(step)


@contextmanager
def tracing_into(sink: StepSink) -> Iterator[None]:
    """Send every mark to `sink` until the block exits. One sink at a time."""
    global _sink
    if _sink is not None:
        raise RuntimeError("a step sink is already installed")
    _sink = sink
    try:
        yield
    finally:
        _sink = None
