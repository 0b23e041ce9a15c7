"""The tracing SDK of one service process, from the standard OTEL_* variables.

Off unless OTEL_TRACES_EXPORTER names an exporter (unset or `none`: no SDK is set up at all).
`console` writes one JSON object per span to stderr (stdout carries only the lines scripts
parse); `otlp` sends them to OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT over the protocol
OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL names (`grpc` unless it says `http/protobuf`), when that
exporter's package is installed. The SDK reads the rest itself: OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES (the service name defaults to `prefill-svc` / `decode-svc`),
OTEL_TRACES_SAMPLER, OTEL_BSP_*, OTEL_EXPORTER_OTLP_HEADERS... Asked for traces without the
SDK installed, or for an exporter it cannot build, the process says so once at start-up and
runs without them."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from shared.otel import spans

log = logging.getLogger(__name__)

EXPORTERS = ("console", "otlp")
OTLP_PACKAGES = {
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "opentelemetry-exporter-otlp-proto-grpc"),
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry-exporter-otlp-proto-http"),
}

_provider: Any = None  # the SDK TracerProvider this process set up (None: tracing off)


def requested_exporters(environ: Mapping[str, str]) -> list[str]:
    """The exporters OTEL_TRACES_EXPORTER names ([] : tracing off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    return [n for n in names if n and n != "none"]


def configure_tracing(service: str, engine_id: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Set up the SDK when the variables ask for traces; True when tracing is on."""
    global _provider
    names = requested_exporters(environ)
    if not names:
        return False
    try:
        from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "OTEL_TRACES_EXPORTER=%s asks for traces, but opentelemetry-sdk is not installed "
            "(pip install 'hybrid-pd[otel]'): tracing is off",
            environ.get("OTEL_TRACES_EXPORTER"),
        )
        return False
    exporters = [e for e in (_exporter(name, environ) for name in names) if e is not None]
    if not exporters:
        return False
    resource = Resource.create({})  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    ours: dict[str, str] = {SERVICE_INSTANCE_ID: engine_id} if engine_id else {}
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        ours[SERVICE_NAME] = service
    provider = TracerProvider(resource=resource.merge(Resource(ours)))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    spans.install(provider)
    log.info("tracing on: %s, service.name %s", ", ".join(names), provider.resource.attributes.get(SERVICE_NAME))
    return True


def _exporter(name: str, environ: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stderr, formatter=lambda span: span.to_json(indent=None) + "\n")
    if name == "otlp":
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        if protocol not in OTLP_PACKAGES:
            log.warning("OTLP protocol %r is not supported here (%s): no OTLP traces", protocol, ", ".join(OTLP_PACKAGES))
            return None
        module, package = OTLP_PACKAGES[protocol]
        try:
            exporter_module = importlib.import_module(module)
        except ImportError:
            log.warning("OTEL_TRACES_EXPORTER names otlp (%s), but %s is not installed: no OTLP traces", protocol, package)
            return None
        return exporter_module.OTLPSpanExporter()
    log.warning("trace exporter %r is not supported here (%s): ignored", name, ", ".join(EXPORTERS))
    return None


def shutdown_tracing() -> None:
    """Export what is still queued and stop tracing (at process exit)."""
    global _provider
    if _provider is not None:
        spans.uninstall()
        _provider.shutdown()
        _provider = None
