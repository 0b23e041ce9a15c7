"""The tracing SDK from the OTEL_* variables: off unless an exporter is named, the console
exporter's one JSON line per span on stderr, the service name and its override, what is said
when the SDK or an exporter's package is missing; and the span functions' cheap path when off."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

from shared.otel import spans
from shared.otel.setup import configure_tracing, requested_exporters, shutdown_tracing


@pytest.fixture(autouse=True)
def tracing_reset() -> Iterator[None]:
    assert not spans.enabled()
    yield
    shutdown_tracing()
    spans.uninstall()


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_TRACES_EXPORTER": " "},
        {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"},
    ],
    ids=["unset", "none", "blank", "sdk-disabled"],
)
def test_off_unless_an_exporter_is_named(environ: dict[str, str]) -> None:
    assert requested_exporters(environ) == []
    assert configure_tracing("decode-svc", "d1", environ) is False
    assert not spans.enabled()


def test_console_writes_one_json_line_per_span_to_stderr(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert configure_tracing("decode-svc", "engine-7", {"OTEL_TRACES_EXPORTER": "console"}) is True
    assert spans.enabled()
    spans.finish(spans.start("unit-span", attributes={"hybrid_pd.request_id": "r"}), "OK")
    shutdown_tracing()  # flushes the batch
    assert not spans.enabled()
    out = capsys.readouterr()
    assert "unit-span" not in out.out  # stdout carries only the lines scripts parse
    [line] = [json.loads(x) for x in out.err.splitlines() if x.startswith("{")]
    assert line["name"] == "unit-span" and line["attributes"]["hybrid_pd.request_id"] == "r"
    assert line["resource"]["attributes"]["service.name"] == "decode-svc"
    assert line["resource"]["attributes"]["service.instance.id"] == "engine-7"


def test_otel_service_name_wins(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-decode")
    assert configure_tracing("decode-svc", "", {"OTEL_TRACES_EXPORTER": "console"}) is True
    spans.finish(spans.start("s"), "OK")
    shutdown_tracing()
    [line] = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert line["resource"]["attributes"]["service.name"] == "my-decode"


def test_without_the_sdk_it_says_so_once_and_stays_off(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # TEST-ONLY fake: the SDK is installed in the dev environment; a None entry in sys.modules
    # makes its import fail as on a host without it.
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with caplog.at_level(logging.WARNING):
        assert configure_tracing("prefill-svc", "p", {"OTEL_TRACES_EXPORTER": "console"}) is False
    assert not spans.enabled()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "opentelemetry-sdk is not installed" in warning and "hybrid-pd[otel]" in warning


def test_unknown_exporter_and_missing_otlp_package_are_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)  # TEST-ONLY: not installed
    with caplog.at_level(logging.WARNING):
        assert configure_tracing("decode-svc", "d", {"OTEL_TRACES_EXPORTER": "zipkin,otlp"}) is False
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "'zipkin' is not supported" in messages
    assert "opentelemetry-exporter-otlp-proto-grpc is not installed" in messages
    assert not spans.enabled()


def test_the_span_functions_do_nothing_when_off() -> None:
    async def items() -> AsyncIterator[int]:
        yield 1

    carrier: dict[str, str] = {}
    spans.inject(carrier)
    assert carrier == {}
    assert spans.start("x") is None and spans.current_context() is None
    with spans.current("x", carrier={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) as span:
        assert span is None
    source = items()
    assert spans.within(None, source) is source  # no wrapper around the token stream
    spans.event("e")
    spans.record("r", None)
