"""Tracing across real service processes: both started with OTEL_TRACES_EXPORTER=console, one
request's spans (each process writes one JSON object per span to stderr) share one trace id,
decode's Generate is the parent of prefill's job, and each process names its own service."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from hybridpd_tools.bench.local_pair import ServiceProcess, start_pair
from shared.otel import spans
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.decode_stream import stream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FLAGS = ["--model", "tiny-mamba2", "--engine", "synthetic", "--num-blocks", "64"]


def spans_of(service: ServiceProcess) -> list[dict[str, Any]]:
    out = []
    for line in service.output:
        if line.startswith("{"):
            record = json.loads(line)
            if "context" in record and "trace_id" in record["context"]:
                out.append(record)
    return out


def test_one_trace_spans_both_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    pair = asyncio.run(start_pair([*FLAGS, "--engine-id", "otel-prefill"], [*FLAGS, "--engine-id", "otel-decode"]))
    try:
        generate = dpb.GenerateRequest(request_id="across-1", prompt_token_ids=[1, 2, 3, 4], max_tokens=3)
        asyncio.run(stream(pair.decode.address, generate, timeout=30))
    finally:
        assert pair.stop() == (0, 0)  # a clean exit exports what is still queued
    decode_spans, prefill_spans = spans_of(pair.decode), spans_of(pair.prefill)
    [request] = [s for s in decode_spans if s["name"] == spans.GENERATE]
    [job] = [s for s in prefill_spans if s["name"] == spans.PREFILL_JOB]
    assert request["attributes"]["hybrid_pd.request_id"] == "across-1" == job["attributes"]["hybrid_pd.request_id"]
    assert request["context"]["trace_id"] == job["context"]["trace_id"]
    assert job["parent_id"] == request["context"]["span_id"]
    assert request["resource"]["attributes"]["service.name"] == "decode-svc"
    assert job["resource"]["attributes"]["service.name"] == "prefill-svc"
    assert job["resource"]["attributes"]["service.instance.id"] == "otel-prefill"
    trace_id = request["context"]["trace_id"]
    names = {s["name"] for s in decode_spans + prefill_spans if s["context"]["trace_id"] == trace_id}
    assert {spans.GENERATE, spans.READ, spans.DIGEST_CHECK, spans.PREFILL_JOB, spans.RELEASE} <= names
