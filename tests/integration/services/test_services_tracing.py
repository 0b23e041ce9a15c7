"""OpenTelemetry spans of a request through a real prefill + decode pair in this process, read
back from the SDK's in-memory exporter: one trace per request with spans from both services
and the right parents, a caller's `traceparent` honoured, failures marked, and no spans at all
with tracing off."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from shared.otel import spans
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.decode_stream import status_of
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Tracing on for this test: an SDK provider exporting synchronously into memory."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    spans.install(provider)
    try:
        yield memory
    finally:
        spans.uninstall()
        provider.shutdown()


def by_name(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def one(finished: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    found = by_name(finished, name)
    assert len(found) == 1, f"{len(found)} spans named {name!r} in {[s.name for s in finished]}"
    return found[0]


@pytest.fixture
def job_contexts(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """The trace_context of every job message prefill receives (a spy on the real session)."""
    from prefill_svc.session import PrefillSession

    seen: list[dict[str, str]] = []
    start_job = PrefillSession._start_job

    def spy(self: PrefillSession, job: Any) -> None:
        seen.append(dict(job.trace_context))
        start_job(self, job)

    monkeypatch.setattr(PrefillSession, "_start_job", spy)
    return seen


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_one_request_is_one_trace_across_both_services(
    exporter: InMemorySpanExporter, job_contexts: list[dict[str, str]], start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    code = await status_of(
        channel_to(decode.port),
        dpb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9], max_tokens=4, request_id="traced-1"),
        timeout=20,
    )
    assert code == grpc.StatusCode.OK
    await until(lambda: prefill.pins.ended["read"] == 1)  # the release span ends with the pin
    finished = exporter.get_finished_spans()
    assert len(job_contexts) == 1 and "traceparent" in job_contexts[0]

    generate_span = one(finished, spans.GENERATE)
    job, read, check, release = (one(finished, n) for n in (spans.PREFILL_JOB, spans.READ, spans.DIGEST_CHECK, spans.RELEASE))
    assert generate_span.context is not None and job.context is not None
    trace_id = generate_span.context.trace_id
    assert {s.context.trace_id for s in finished if s.context is not None} == {trace_id}
    assert generate_span.parent is None and generate_span.kind == SpanKind.SERVER  # no traceparent sent: a new trace
    # Prefill's job is a child of decode's request span through the job message's trace context.
    assert parent_of(job) == generate_span.context.span_id and job.kind == SpanKind.CONSUMER
    assert parent_of(read) == generate_span.context.span_id and read.kind == SpanKind.CLIENT
    assert parent_of(check) == generate_span.context.span_id
    assert parent_of(release) == job.context.span_id

    attrs = generate_span.attributes or {}
    assert attrs["hybrid_pd.request_id"] == "traced-1" and attrs["hybrid_pd.status"] == "OK"
    assert attrs["hybrid_pd.prompt_tokens"] == 5 and attrs["hybrid_pd.max_tokens"] == 4
    assert attrs["hybrid_pd.generated_tokens"] == 4 and attrs["hybrid_pd.prefill_engine_id"] == "test-prefill"
    assert generate_span.status.status_code == StatusCode.UNSET
    manifest = [e for e in generate_span.events if e.name == spans.MANIFEST]
    assert len(manifest) == 1 and (manifest[0].attributes or {})["hybrid_pd.computed_tokens"] == 4
    assert (job.attributes or {})["hybrid_pd.status"] == "OK" and (job.attributes or {})["hybrid_pd.computed_tokens"] == 4
    read_attrs = read.attributes or {}
    assert read_attrs["hybrid_pd.transfer.reads"] == 1 and int(str(read_attrs["hybrid_pd.transfer.bytes"])) > 0
    assert [e.name for e in read.events] == [spans.READ_PAIR]  # TP 1 -> TP 1: one rank pair
    assert (release.attributes or {})["hybrid_pd.release.reason"] == "read"
    # The job and the READ happen inside the request's span.
    assert generate_span.start_time is not None and generate_span.end_time is not None
    assert generate_span.start_time <= job.start_time <= read.start_time <= generate_span.end_time  # type: ignore[operator]


async def test_two_requests_are_two_traces(
    exporter: InMemorySpanExporter, start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    """Negative control of the one-trace check: per-request context, not one shared by the stream."""
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    channel = channel_to(decode.port)
    for rid in ("a", "b"):
        assert (
            await status_of(channel, dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2, request_id=rid), timeout=20)
            == grpc.StatusCode.OK
        )
    finished = exporter.get_finished_spans()
    jobs = by_name(finished, spans.PREFILL_JOB)
    requests = by_name(finished, spans.GENERATE)
    assert len(jobs) == 2 and len(requests) == 2
    trace_of = {(s.attributes or {})["hybrid_pd.request_id"]: s.context.trace_id for s in requests if s.context is not None}
    assert trace_of["a"] != trace_of["b"]
    assert {j.context.trace_id for j in jobs if j.context is not None} == set(trace_of.values())


async def test_a_callers_traceparent_is_honoured(
    exporter: InMemorySpanExporter, start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    metadata = (("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"),)
    code = await status_of(
        channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2), timeout=20, metadata=metadata
    )
    assert code == grpc.StatusCode.OK
    finished = exporter.get_finished_spans()
    generate_span, job = one(finished, spans.GENERATE), one(finished, spans.PREFILL_JOB)
    assert generate_span.context is not None and job.context is not None
    assert generate_span.context.trace_id == int(CALLER_TRACE, 16) == job.context.trace_id
    assert parent_of(generate_span) == int(CALLER_SPAN, 16)


async def test_a_failed_request_is_a_failed_span(
    exporter: InMemorySpanExporter, start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    code = await status_of(
        channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=0, request_id="bad"), timeout=20
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    span = one(exporter.get_finished_spans(), spans.GENERATE)
    assert span.status.status_code == StatusCode.ERROR and "max_tokens" in (span.status.description or "")
    assert (span.attributes or {})["hybrid_pd.status"] == "INVALID_ARGUMENT"
    assert not by_name(exporter.get_finished_spans(), spans.PREFILL_JOB)  # refused before any job


async def test_with_tracing_off_there_are_no_spans(
    job_contexts: list[dict[str, str]], start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    """An SDK provider exists in the process, but none is installed for the services: nothing is
    recorded, and even a caller's traceparent travels no further (the job carries no context)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    assert not spans.enabled()
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    metadata = (("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"),)
    assert (
        await status_of(
            channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2), timeout=20, metadata=metadata
        )
        == grpc.StatusCode.OK
    )
    await until(lambda: prefill.pins.ended["read"] == 1)
    assert memory.get_finished_spans() == ()
    assert job_contexts == [{}]
    provider.shutdown()
