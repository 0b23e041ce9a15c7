"""Decode's and prefill's plain endpoints and the wire format itself: /health follows gRPC
readiness (and the drain, with Retry-After on refused work), /metrics is the service's registry
and counts HTTP requests, /version, unknown routes, malformed JSON, and SSE framing as curl
receives it byte for byte."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_svc.app import SERVICE_NAME
from tests.integration.http.conftest import MODEL, HttpPair, request, start_pair, stop_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


async def grpc_ready(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def test_health_metrics_version_on_both_services(http_pair: HttpPair) -> None:
    for app in (http_pair.decode, http_pair.prefill):
        base = f"http://127.0.0.1:{app.shell.http_port}"
        health = await asyncio.to_thread(request, base + "/health")
        assert health.status == 200
        version = await asyncio.to_thread(request, base + "/version")
        assert version.json()["version"] == "0.1.0"
        models = await asyncio.to_thread(request, base + "/v1/models")
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
        assert models.json()["data"][0]["max_model_len"] == app.host.max_tokens() > 0
    assert await grpc_ready(http_pair.decode.port)
    before = await asyncio.to_thread(request, http_pair.base_url + "/metrics")
    ok = await asyncio.to_thread(request, http_pair.base_url + "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert ok.status == 200
    after = await asyncio.to_thread(request, http_pair.base_url + "/metrics")
    assert after.headers["content-type"].startswith("text/plain")

    def ok_count(text: bytes) -> float:
        lines = [line for line in text.decode().splitlines() if line.startswith('hybrid_pd_requests_total{status="OK"}')]
        return float(lines[0].split()[-1]) if lines else 0.0

    assert ok_count(after.body) == ok_count(before.body) + 1  # the same counter gRPC Generate feeds


async def test_unknown_routes_and_bad_json_are_openai_errors(http_pair: HttpPair) -> None:
    missing = await asyncio.to_thread(request, http_pair.base_url + "/v1/nothing")
    assert missing.status == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    wrong_method = await asyncio.to_thread(request, http_pair.base_url + "/v1/completions", method="GET")
    assert wrong_method.status == 405
    bad = await asyncio.to_thread(request, http_pair.base_url + "/v1/completions", b"{not json")
    assert bad.status == 400 and bad.json()["error"]["param"] == "body"
    long_id = await asyncio.to_thread(
        request, http_pair.base_url + "/v1/completions", {"prompt": "a", "max_tokens": 1}, headers={"X-Request-Id": "x" * 200}
    )
    assert long_id.status == 400 and long_id.json()["error"]["param"] == "X-Request-Id"
    assert http_pair.decode.host.allocator.num_used == 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed (apt-get install curl)")
async def test_sse_framing_as_curl_receives_it(http_pair: HttpPair) -> None:
    body = json.dumps({"model": MODEL, "prompt": "frame me", "max_tokens": 20, "stream": True})
    run = await asyncio.to_thread(
        subprocess.run,
        ["curl", "-sS", "-N", "-D", "-", "-H", "Content-Type: application/json", "-d", body, http_pair.base_url + "/v1/completions"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    head, _, stream = run.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-type: text/event-stream" in head.lower()
    assert stream.endswith(b"data: [DONE]\n\n")
    events = stream.split(b"\n\n")
    assert events[-1] == b""  # every event ends with a blank line
    events = events[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    payloads = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "length"
    assert "".join(p["choices"][0]["text"] for p in payloads) == http_pair.expected_text("frame me", 20)


async def test_health_is_503_until_a_prefill_is_ready_and_during_the_drain() -> None:
    pair = await start_pair("--drain-seconds", "20", "--local-prefill", "off", ready=False)
    try:
        # Decode with its prefill stopped: gRPC readiness NOT_SERVING, and /health says the same.
        await pair.prefill.stop()
        async with asyncio.timeout(20):
            while pair.decode.peers.any_ready:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        health = await asyncio.to_thread(request, pair.base_url + "/health")
        assert health.status == 503 and not await grpc_ready(pair.decode.port)
        refused = await asyncio.to_thread(request, pair.base_url + "/v1/completions", {"prompt": "a", "max_tokens": 1})
        assert refused.status == 503 and "retry-after" in refused.headers
    finally:
        await stop_pair(pair)


async def test_drain_refuses_new_work_with_503_and_retry_after_and_finishes_what_runs() -> None:
    pair = await start_pair("--drain-seconds", "20")
    try:
        long = asyncio.ensure_future(
            asyncio.to_thread(request, pair.base_url + "/v1/completions", {"prompt": "long", "max_tokens": 600})
        )
        async with asyncio.timeout(20):
            while not pair.decode.servicer.generation.in_flight:
                await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(pair.decode.stop())
        async with asyncio.timeout(10):
            while not pair.decode.shell.lifecycle.draining.is_set():
                await asyncio.sleep(0.01)
        health = await asyncio.to_thread(request, pair.base_url + "/health")
        refused = await asyncio.to_thread(request, pair.base_url + "/v1/completions", {"prompt": "late", "max_tokens": 1})
        finished = await long
        await asyncio.wait_for(stopping, 30)
    finally:
        await stop_pair(pair)
    assert health.status == 503
    assert refused.status == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    assert finished.status == 200 and finished.json()["usage"]["completion_tokens"] == 600
