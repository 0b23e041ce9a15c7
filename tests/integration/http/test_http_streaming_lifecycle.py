"""A streamed completion's first event leaves while the generation is still running (it does
not wait for the rest), and a client that hangs up mid-stream stops the generation: the request
ends as CANCELLED and its blocks are freed on both sides."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.http.conftest import MODEL, HttpPair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


async def test_first_event_leaves_early_and_a_hang_up_cancels(http_pair: HttpPair) -> None:
    decode = http_pair.decode
    body = json.dumps({"model": MODEL, "prompt": "keep going", "max_tokens": 1500, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", decode.shell.http_port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    first = await reader.readuntil(b"\n\n")  # chunked framing around it: find the event inside
    assert b"data: {" in first and b'"finish_reason":null' in first
    assert decode.servicer.generation.in_flight == 1  # the rest is still being generated
    cancelled = decode.metrics.registry.get_sample_value("hybrid_pd_requests_total", {"status": "CANCELLED"}) or 0
    writer.close()
    await writer.wait_closed()
    async with asyncio.timeout(20):
        while decode.servicer.generation.in_flight:
            await asyncio.sleep(0.02)
    await http_pair.blocks_freed()
    assert decode.metrics.registry.get_sample_value("hybrid_pd_requests_total", {"status": "CANCELLED"}) == cancelled + 1
