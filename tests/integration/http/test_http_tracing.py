"""Tracing through decode's HTTP API on a real pair: the HTTP server span continues the
caller's `traceparent` header, and the request it starts (Generate, prefill's job, the READ)
stays in that trace, streamed or not."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from shared.otel import spans
from tests.integration.http.conftest import MODEL, HttpPair, request, start_pair, stop_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def traced_pair() -> AsyncIterator[tuple[HttpPair, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    spans.install(provider)
    pair = await start_pair()
    try:
        yield pair, memory
    finally:
        await stop_pair(pair)
        spans.uninstall()
        provider.shutdown()


def named(finished: tuple[ReadableSpan, ...], name: str, trace_id: int) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name and s.context is not None and s.context.trace_id == trace_id]


async def http_span_ended(memory: InMemorySpanExporter, name: str = "POST /v1/completions") -> None:
    async with asyncio.timeout(10):
        while not [s for s in memory.get_finished_spans() if s.name == name]:
            await asyncio.sleep(0.01)


async def completion(pair: HttpPair, stream: bool, headers: dict[str, str]) -> int:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": stream}
    reply = await asyncio.to_thread(request, f"{pair.base_url}/v1/completions", body, headers=headers)
    return reply.status


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_http_span_honours_traceparent_and_the_request_stays_in_its_trace(
    traced_pair: tuple[HttpPair, InMemorySpanExporter], stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    pair, memory = traced_pair
    memory.clear()
    with caplog.at_level(logging.ERROR, logger="opentelemetry"):
        assert await completion(pair, stream, {"traceparent": TRACEPARENT}) == 200
        await pair.blocks_freed()
        # The server span ends when the app returns, just after the last byte the client read.
        await http_span_ended(memory)
    finished = memory.get_finished_spans()
    trace_id = int(CALLER_TRACE, 16)
    [http] = named(finished, "POST /v1/completions", trace_id)
    [generate] = named(finished, spans.GENERATE, trace_id)
    [job] = named(finished, spans.PREFILL_JOB, trace_id)
    [read] = named(finished, spans.READ, trace_id)
    assert http.kind == SpanKind.SERVER and http.parent is not None and http.parent.span_id == int(CALLER_SPAN, 16)
    assert (http.attributes or {})["http.response.status_code"] == 200
    assert http.context is not None and generate.context is not None
    assert generate.kind == SpanKind.INTERNAL and generate.parent is not None and generate.parent.span_id == http.context.span_id
    assert job.parent is not None and job.parent.span_id == generate.context.span_id
    assert read.parent is not None and read.parent.span_id == generate.context.span_id
    # Resumed from another task while streaming: the span is made current per step, never
    # attached in one task and detached in another.
    assert not [r for r in caplog.records if "detach" in r.getMessage()]


async def test_without_traceparent_the_http_span_starts_a_trace(traced_pair: tuple[HttpPair, InMemorySpanExporter]) -> None:
    pair, memory = traced_pair
    memory.clear()
    assert await completion(pair, False, {}) == 200
    await http_span_ended(memory)
    finished = memory.get_finished_spans()
    [http] = [s for s in finished if s.name == "POST /v1/completions"]
    assert http.parent is None and http.context is not None and http.context.trace_id != int(CALLER_TRACE, 16)
    [generate] = [s for s in finished if s.name == spans.GENERATE]
    assert generate.context is not None and generate.context.trace_id == http.context.trace_id


async def test_an_unknown_path_is_named_by_its_method_alone(traced_pair: tuple[HttpPair, InMemorySpanExporter]) -> None:
    pair, memory = traced_pair
    memory.clear()
    reply = await asyncio.to_thread(request, f"{pair.base_url}/no/such/path-123", None, "GET")
    assert reply.status == 404
    await http_span_ended(memory, "GET")
    [span] = memory.get_finished_spans()
    assert span.name == "GET" and (span.attributes or {})["http.response.status_code"] == 404
