"""One instrumentation path for the request paths: metrics, spans and benchmark breakdowns.

A request path says what happened once, in one of three shapes, and every installed sink takes
what it listens to:

- `mark(Step.X)`: a request passed a named step (a point in time, on whichever thread reaches
  it); `bench control --breakdown` turns the marks into step timings.
- `stage(Stage.X, seconds, attributes)`: a named stage ended after `seconds`, with what it did
  in `attributes`; a service's metrics observe it, the tracer puts it on a span (the current
  one's attributes or events, a span of its own, or the end of the span `within` holds), and a
  stage that ends a step of the breakdown (`END_STEPS`) marks it.
- `count(Count.X, n, kind)`: `n` more of something happened (a cache hit, evicted blocks, a
  retry for a reason); a service's metrics add it to a counter.

Counts go through here too, though only metrics read them today: a request path then knows one
thing, its `Observer`, never the metrics registry (no `Telemetry | None` to check at each call),
a test reads what it counted with a sink of its own, and a span or breakdown that wants a count
later needs no change at the call site.

Sinks: process-wide ones (`add` / `remove`: the tracer, from shared/otel/spans.py `install`; a
benchmark's breakdown, `tracing_into`), and a service's own metrics, which an `Observer` carries
(two services in one process keep their own counts). With nothing installed a report is one
global read and a branch; a call site that builds attributes asks `listening()` first.

Step names carry the place they run: `d.` decode's event loop, `p.` prefill's event loop,
`o.` an agent's owner thread, `c.` prefill's compute thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol

from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

Attributes = Mapping[str, AttributeValue]
NO_ATTRIBUTES: Attributes = MappingProxyType({})


class Step(StrEnum):
    """Every step a service marks. The comment is where the mark is made."""

    JOB_QUEUED = "d.job_queued"  # decode_svc/session_client.py: the job is queued for the Session stream
    JOB_RECEIVED = "p.job_received"  # prefill_svc/session.py: a job message arrived, before its task starts
    JOB_STARTED = "p.job_started"  # prefill_svc/jobs.py: the job task runs (credit taken)
    ALLOCATED = "p.allocated"  # shared/runtime/engine_host.py: queued block allocation returned (Stage.QUEUE_WAIT ends)
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


class Stage(StrEnum):
    """Every stage a service reports when it ends. The comment is where, and its attributes."""

    READ = "decode.read"  # decode_svc/reader.py: one manifest's READs done; read_attributes
    READ_PAIR = "decode.read_pair"  # decode_svc/reader.py: one rank pair's READ done; seconds: its post; the ranks
    TRANSFER = "decode.transfer"  # decode_svc/generation.py: a request's READs done (the time left exposed); TRANSFER_*
    DECODE_STEP = "decode.step"  # shared/runtime/step_loop.py: one decode step's engine time; BATCH_SIZE
    PREFILL_STEP = "prefill.step"  # shared/runtime/prefill_loop.py: one prefill step's engine time; BATCH_SIZE, TOKENS
    QUEUE_WAIT = "queue_wait"  # shared/runtime/engine_host.py: a request's or job's wait for free blocks
    RELEASE = "prefill.release"  # prefill_svc/pins.py: a pinned request ended, its blocks free; seconds: pinned; RELEASE_*
    MANIFEST = "decode.manifest"  # decode_svc/session_client.py: a job's manifest reached its request; seconds: since queued
    FIRST_TOKEN = "decode.first_token"  # decode_svc/responses.py: a request's first token sent; seconds: since it arrived
    TOKENS = "decode.tokens"  # decode_svc/servicer.py: a later chunk sent; seconds: since the one before; TOKENS
    REQUEST = "decode.request"  # decode_svc/servicer.py: a Generate request ended; seconds: its duration; STATUS, ...


class Count(StrEnum):
    """Everything a service counts. The comment is where, and what its `kind` is (if it has one)."""

    PREFIX_CACHE_HIT = "decode.prefix_cache.hit"  # decode_svc/prefix_cache.py: a prompt found leading blocks
    PREFIX_CACHE_MISS = "decode.prefix_cache.miss"  # decode_svc/prefix_cache.py: it found none
    PREFIX_CACHE_EVICTED = "decode.prefix_cache.evicted"  # decode_svc/prefix_cache.py: blocks given up
    PREFIX_CACHE_SAVED_BYTES = "decode.prefix_cache.saved_bytes"  # decode_svc/reuse.py: K/V bytes not READ
    PREFIX_STATE_HIT = "decode.prefix_state.hit"  # decode_svc/state_checkpoints.py: a checkpoint of the prompt
    PREFIX_STATE_MISS = "decode.prefix_state.miss"  # decode_svc/state_checkpoints.py: none to use
    PREFIX_STATE_EVICTED = "decode.prefix_state.evicted"  # decode_svc/state_checkpoints.py: a checkpoint given up
    PREFIX_STATE_SAVED_BYTES = "decode.prefix_state.saved_bytes"  # decode_svc/reuse.py: bytes not READ
    PREFIX_STATE_WITHOUT_PREFILL = "decode.prefix_state.without_prefill"  # decode_svc/generation.py: no prefill was ready
    PREFILL_RETRY = "decode.prefill_retry"  # decode_svc/generation.py: a job sent elsewhere; kind: the reason
    LOCAL_PREFILL = "decode.local_prefill"  # decode_svc/local_prefill.py: a prompt computed on decode; kind: why
    DIGEST_MISMATCH = "decode.digest_mismatch"  # decode_svc/read_checks.py: a digest differs; kind: its section
    BOUNDARY_HIT = "prefill.boundary.hit"  # prefill_svc/boundary_cache.py: a job starts at a cached boundary
    BOUNDARY_MISS = "prefill.boundary.miss"  # prefill_svc/boundary_cache.py: it found none
    BOUNDARY_SKIPPED_TOKENS = "prefill.boundary.skipped_tokens"  # prefill_svc/boundary_cache.py: tokens not computed
    BOUNDARY_EVICTED = "prefill.boundary.evicted"  # prefill_svc/boundary_cache.py: a boundary given up
    HANDSHAKE = "prefill.handshake"  # prefill_svc/servicer.py: a decode engine's handshake; kind: its result


# Attribute keys (the READ span's attributes are these transfer keys).
BATCH_SIZE = "hybrid_pd.batch_size"
TOKENS = "hybrid_pd.tokens"
TRANSFER_READS = "hybrid_pd.transfer.reads"
TRANSFER_DESCRIPTORS = "hybrid_pd.transfer.descriptors"
TRANSFER_BYTES = "hybrid_pd.transfer.bytes"
TRANSFER_ATTENTION_BYTES = "hybrid_pd.transfer.attention_bytes"
TRANSFER_CONV_BYTES = "hybrid_pd.transfer.conv_bytes"
TRANSFER_SSM_BYTES = "hybrid_pd.transfer.ssm_bytes"
TRANSFER_POST_SECONDS = "hybrid_pd.transfer.post_seconds"  # one per READ posted
RELEASE_REASON = "hybrid_pd.release.reason"  # read, released, lease_expired, ...
STATUS = "hybrid_pd.status"  # the gRPC status name a request or job ended with ("OK": it succeeded)
FAILURE_REASON = "hybrid_pd.failure.reason"  # only a failure whose reason has its own count
ERROR_MESSAGE = "hybrid_pd.error"  # the failure's message (a span's status says it, not an attribute)

# A stage whose end is also a step of the breakdown (marked where the stage is reported).
END_STEPS = {Stage.RELEASE: Step.FREED, Stage.QUEUE_WAIT: Step.ALLOCATED}


class Sink:
    """What a sink can be told; each does nothing here, a sink overrides what it listens to."""

    def mark(self, step: Step) -> None:
        """A request passed `step` (called on the thread that reached it)."""

    def stage(self, stage: Stage, seconds: float, attributes: Attributes, within: Context | None) -> None:
        """`stage` ended after `seconds`. `within`: the trace context it belongs to, kept when it
        began (None: the current one, or tracing was off then)."""

    def count(self, count: Count, n: float, kind: str) -> None:
        """`n` more of `count` (`kind`: which of its kinds, "" where it has none)."""


_sinks: tuple[Sink, ...] = ()  # replaced whole, never changed in place: any thread may read it


def add(sink: Sink) -> None:
    """Send every report of this process to `sink` from now on."""
    global _sinks
    if sink not in _sinks:
        _sinks = (*_sinks, sink)


def remove(sink: Sink) -> None:
    global _sinks
    _sinks = tuple(s for s in _sinks if s is not sink)


def listening() -> bool:
    """Whether a process-wide sink is installed (build attributes only then)."""
    return bool(_sinks)


def mark(step: Step) -> None:
    """Record that the current request reached `step`."""
    sinks = _sinks
    if sinks:
        for sink in sinks:
            sink.mark(step)


def stage(stage: Stage, seconds: float, attributes: Attributes = NO_ATTRIBUTES, *, within: Context | None = None) -> None:
    """Report to the process-wide sinks that `stage` ended."""
    sinks = _sinks
    if sinks:
        for sink in sinks:
            sink.stage(stage, seconds, attributes, within)


class Observer:
    """Where one component reports stages: its own sinks (its service's metrics) and the
    process-wide ones."""

    def __init__(self, *sinks: Sink) -> None:
        self._own = sinks

    def listening(self) -> bool:
        return bool(self._own) or bool(_sinks)

    def stage(
        self, stage: Stage, seconds: float, attributes: Attributes = NO_ATTRIBUTES, *, within: Context | None = None
    ) -> None:
        for sink in self._own:
            sink.stage(stage, seconds, attributes, within)
        for sink in _sinks:
            sink.stage(stage, seconds, attributes, within)

    def count(self, count: Count, n: float = 1, kind: str = "") -> None:
        for sink in self._own:
            sink.count(count, n, kind)
        for sink in _sinks:
            sink.count(count, n, kind)


def number(attributes: Attributes, key: str) -> float:
    """A numeric attribute of a stage (a sink reading what a call site reported)."""
    value = attributes[key]
    if not isinstance(value, int | float):
        raise TypeError(f"stage attribute {key} is {type(value).__name__}, not a number")
    return value


def numbers(attributes: Attributes, key: str) -> list[float]:
    """A list of numbers a stage reported (one per READ posted, ...)."""
    values = attributes[key]
    if isinstance(values, Sequence) and not isinstance(values, str):
        out = [float(v) for v in values if isinstance(v, int | float)]
        if len(out) == len(values):
            return out
    raise TypeError(f"stage attribute {key} is not a list of numbers")


class StepSink(Protocol):
    def mark(self, step: str) -> None: ...


class _Breakdown(Sink):
    """A benchmark's step sink, which listens to marks only."""

    def __init__(self, steps: StepSink) -> None:
        self.steps = steps

    def mark(self, step: Step) -> None:
        self.steps.mark(step)

    def stage(self, stage: Stage, seconds: float, attributes: Attributes, within: Context | None) -> None:
        step = END_STEPS.get(stage)
        if step is not None:
            self.steps.mark(step)


_sink: _Breakdown | None = None  # the installed breakdown, if any


@contextmanager
def tracing_into(sink: StepSink) -> Iterator[None]:
    """Send every mark to `sink` until the block exits. One breakdown at a time: the traced
    benchmark pass runs one request at a time through both services in one process."""
    global _sink
    if _sink is not None:
        raise RuntimeError("a step sink is already installed")
    _sink = _Breakdown(sink)
    add(_sink)
    try:
        yield
    finally:
        remove(_sink)
        _sink = None
