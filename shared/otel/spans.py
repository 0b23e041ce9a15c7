"""OpenTelemetry spans of one request across both services (README "Tracing").

Tracing is off until a tracer provider is installed: by shared/otel/setup.py when the OTEL_*
variables ask for it, or by a test with its own SDK provider. Every function here reads one module
global first, so with tracing off a request pays a few function calls and builds no span,
context or carrier.

Per-request context crosses processes as a W3C `traceparent` (and `tracestate`): in an HTTP
request's headers, a Generate call's gRPC metadata, or the `trace_context` map of the job or
claim message on the long-lived Session stream (a stream's metadata belongs to every request
it carries, so it cannot say which trace a job is in).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, MutableMapping
from types import MappingProxyType
from typing import Any, ParamSpec, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, TracerProvider

from shared import observe
from shared.observe import NO_ATTRIBUTES, Attributes
from shared.version import version

P = ParamSpec("P")
T = TypeVar("T")

# Span names (the README lists them with their attributes).
GENERATE = "hybridpd.v1.DecodeService/Generate"  # decode: one request, from arrival to its summary
PREFILL_JOB = "prefill.job"  # prefill: one job, from its message to its manifest (or failure)
CLAIM = "prefill.claim"  # prefill: a P/D decode leg takes over a pinned request
READ = "decode.read"  # decode: every READ of the request (an event per rank pair)
DIGEST_CHECK = "decode.digest_check"  # decode: the READ state against prefill's digests
RELEASE = "prefill.release"  # prefill: a pinned request ends and its blocks are freed
# Events.
MANIFEST = "manifest"  # on GENERATE: the manifest arrived
READ_PAIR = "read.pair"  # on READ: one (decode rank, prefill rank) READ completed

NO_CARRIER: Mapping[str, str] = MappingProxyType({})

_tracer: Tracer | None = None


class _StageSpans(observe.Sink):
    """The stages the request paths report (shared/observe.py) as spans: the READ span's
    attributes, an event per rank pair's READ, the release span, the manifest event and the end
    of the request's span (the one `within` holds, started when the request arrived)."""

    def stage(self, stage: observe.Stage, seconds: float, attributes: Attributes, within: Context | None) -> None:
        if stage is observe.Stage.READ:
            trace.get_current_span().set_attributes(attributes)
        elif stage is observe.Stage.READ_PAIR:
            trace.get_current_span().add_event(READ_PAIR, {**attributes, "hybrid_pd.post_ms": _ms(seconds)})
        elif stage is observe.Stage.RELEASE:
            record(RELEASE, within, {**attributes, "hybrid_pd.pinned_ms": _ms(seconds)})
        elif stage is observe.Stage.MANIFEST:
            trace.get_current_span().add_event(MANIFEST, attributes)
        elif stage is observe.Stage.REQUEST and within is not None:  # None: tracing was off when it arrived
            _end_request(trace.get_current_span(within), attributes)


def _end_request(span: Span, attributes: Attributes) -> None:
    message = str(attributes.get(observe.ERROR_MESSAGE, ""))
    kept = {k: v for k, v in attributes.items() if k != observe.ERROR_MESSAGE}
    finish(span, str(attributes[observe.STATUS]), kept, message)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


_STAGE_SPANS = _StageSpans()


def install(provider: TracerProvider) -> None:
    """Trace with `provider` from now on (set up once per process, or by a test)."""
    global _tracer
    _tracer = provider.get_tracer("hybrid_pd", version())
    observe.add(_STAGE_SPANS)


def uninstall() -> None:
    global _tracer
    _tracer = None
    observe.remove(_STAGE_SPANS)


def enabled() -> bool:
    return _tracer is not None


def extract(carrier: Mapping[str, str]) -> Context | None:
    """The context a `traceparent` in `carrier` names (None: tracing off). Without one, the
    current context: the span started in it begins a new trace or continues the current one."""
    if _tracer is None:
        return None
    return propagate.extract(carrier) if carrier else None


def inject(carrier: MutableMapping[str, str]) -> None:
    """Write the current span's context into `carrier` (a job's `trace_context`, headers)."""
    if _tracer is not None:
        propagate.inject(carrier)


def start(
    name: str, *, kind: SpanKind = SpanKind.INTERNAL, parent: Context | None = None, attributes: Attributes = NO_ATTRIBUTES
) -> Span | None:
    """A span that is not made current (end it with `finish`); None when tracing is off."""
    tracer = _tracer
    if tracer is None:
        return None
    return tracer.start_span(name, context=parent, kind=kind, attributes=attributes)


def settle(span: Span, status: str, attributes: Attributes = NO_ATTRIBUTES, message: str = "") -> None:
    """Give `span` the work's final status (a gRPC status name, "OK" when it succeeded)."""
    span.set_attributes(attributes)
    span.set_attribute(observe.STATUS, status)
    if status != "OK":
        span.set_status(Status(StatusCode.ERROR, f"{status}: {message}" if message else status))


def finish(span: Span | None, status: str, attributes: Attributes = NO_ATTRIBUTES, message: str = "") -> None:
    """Settle and end a span from `start`."""
    if span is not None:
        settle(span, status, attributes, message)
        span.end()


@contextlib.contextmanager
def _current(name: str, kind: SpanKind, parent: Context | None, attributes: Attributes) -> Iterator[Span]:
    assert _tracer is not None
    with _tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes, end_on_exit=True) as span:
        yield span


_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()


def current(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    carrier: Mapping[str, str] = NO_CARRIER,
    attributes: Attributes = NO_ATTRIBUTES,
) -> contextlib.AbstractContextManager[Span | None]:
    """`with current(...) as span:` a span made current for the block (span None when tracing
    is off); its parent is the context `carrier` carries, else the current one."""
    if _tracer is None:
        return _OFF
    return _current(name, kind, extract(carrier), attributes)


def traced(name: str, kind: SpanKind = SpanKind.INTERNAL) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Decorate a coroutine function: each call runs in a span of its own (an exception marks
    it failed), a child of the current span."""

    def wrap(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> Awaitable[T]:
            tracer = _tracer
            if tracer is None:  # off: the call itself, no coroutine around it to resume at every await
                return fn(*args, **kwargs)
            return _in_span(tracer, name, kind, fn(*args, **kwargs))

        return run

    return wrap


async def _in_span(tracer: Tracer, name: str, kind: SpanKind, work: Awaitable[T]) -> T:
    with tracer.start_as_current_span(name, kind=kind):
        return await work


def within(span: Span | None, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """Iterate `items` with `span` current while each item is produced. An async generator may
    be resumed from different tasks (the HTTP API starts a request in one and streams it from
    another), so the span is made current for each step, never across a yield."""
    if span is None:
        return items
    return _within(trace.set_span_in_context(span), items)


async def _within(ctx: Context, items: AsyncIterator[T]) -> AsyncIterator[T]:
    while True:
        token = otel_context.attach(ctx)
        try:
            item = await anext(items)
        except StopAsyncIteration:
            return
        finally:
            otel_context.detach(token)
        yield item


def event(name: str, attributes: Attributes = NO_ATTRIBUTES) -> None:
    """An event on the current span (nothing when tracing is off or no span is current)."""
    if _tracer is not None:
        trace.get_current_span().add_event(name, attributes)


def current_context() -> Context | None:
    """The current context, to parent a span that starts later elsewhere (None: tracing off)."""
    return otel_context.get_current() if _tracer is not None else None


def record(name: str, parent: Context | None, attributes: Attributes = NO_ATTRIBUTES) -> None:
    """A span that ends now, under `parent` (a context kept from earlier); nothing when `parent`
    is None, i.e. tracing was off when it was kept."""
    tracer = _tracer
    if tracer is None or parent is None:
        return
    tracer.start_span(name, context=parent, attributes=attributes).end()


def grpc_parent(call: Any) -> Context | None:
    """The context the `traceparent` metadata of a gRPC call names (`call`: its servicer
    context; None: tracing off or none sent)."""
    if _tracer is None:
        return None
    metadata = call.invocation_metadata() or ()
    return extract({str(key): value for key, value in metadata if isinstance(value, str)})
