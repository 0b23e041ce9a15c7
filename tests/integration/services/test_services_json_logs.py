"""`--log-format json` on real service processes: every line is a JSON object, and a request's
lines (the per-request summary on decode, the per-job line on prefill) carry its request id."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from hybridpd_tools.bench.local_pair import LocalPair, ServiceProcess, start_pair
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.decode_stream import status_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FLAGS = ["--model", "tiny-mamba2", "--engine", "synthetic", "--num-blocks", "64", "--log-format", "json"]


@pytest.fixture(scope="module")
def pair() -> Iterator[LocalPair]:
    running = asyncio.run(start_pair([*FLAGS, "--engine-id", "json-prefill"], [*FLAGS, "--engine-id", "json-decode"]))
    try:
        yield running
    finally:
        running.stop()


def json_lines(service: ServiceProcess) -> list[dict[str, Any]]:
    """Every log line so far, parsed; stdout's own lines (LISTENING ...) are not JSON."""
    out = []
    for line in list(service.output):
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def wait_for_line(service: ServiceProcess, message: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in json_lines(service):
            if line["message"] == message:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line {message!r} from {service.role}; last lines: {service.output[-5:]}")


def test_a_finished_request_is_one_json_line_with_its_numbers(pair: LocalPair) -> None:
    request = dpb.GenerateRequest(request_id="json-ok-1", prompt_token_ids=[1, 2, 3, 4], max_tokens=5)
    assert asyncio.run(status_of(pair.decode.address, request, timeout=30)) == grpc.StatusCode.OK
    line = wait_for_line(pair.decode, "request json-ok-1 finished: OK")
    assert line["request_id"] == "json-ok-1" and line["level"] == "INFO" and line["status"] == "OK"
    assert line["service"] == "decode-svc" and line["engine_id"] == "json-decode"
    assert line["peer"].startswith("ipv4:127.0.0.1:") and line["prefill"] == "json-prefill"
    assert line["prompt_tokens"] == 4 and line["generated_tokens"] == 5
    assert line["bytes_moved"] > 0 and line["reads"] == 1
    assert line["read_ms"] > 0 and line["ttft_ms"] > 0 and line["total_ms"] >= line["ttft_ms"]
    job = wait_for_line(pair.prefill, "job json-ok-1 finished: OK")
    assert job["request_id"] == "json-ok-1" and job["service"] == "prefill-svc" and job["engine_id"] == "json-prefill"
    assert job["peer"].startswith("json-decode") and job["prompt_tokens"] == 4 and job["blocks"] > 0
    # Every line of either service is JSON (nothing printed in another format on stderr).
    for service in (pair.decode, pair.prefill):
        other = [line for line in service.output if not line.startswith(("{", "LISTENING", "METRICS", "HTTP"))]
        assert other == [], other


def test_a_failed_request_logs_its_status_with_its_id(pair: LocalPair) -> None:
    request = dpb.GenerateRequest(request_id="json-bad-1", prompt_token_ids=[1, 2], max_tokens=1_000_000)
    assert asyncio.run(status_of(pair.decode.address, request, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
    line = wait_for_line(pair.decode, "request json-bad-1 finished: INVALID_ARGUMENT")
    assert line["request_id"] == "json-bad-1" and line["status"] == "INVALID_ARGUMENT"
    assert line["error"].startswith("max_tokens")
    # The interceptor's line about the same failure names the request too.
    assert any(x.get("request_id") == "json-bad-1" and "INVALID_ARGUMENT" in x["message"] for x in json_lines(pair.decode))
