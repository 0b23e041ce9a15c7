"""The gRPC shell around one service: server, health, reflection, metrics, listening, drain."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from shared.config import ServiceSettings
from shared.http.server import HttpServer, announce_http_port
from shared.rpc.health import HealthStatus
from shared.rpc.lifecycle import Lifecycle
from shared.rpc.server import build_server, enable_reflection, listen
from shared.runtime import faults
from shared.runtime.metrics import ServiceMetrics, announce_metrics_port


def announce_port(port: int) -> None:
    """The one stdout line scripts parse to find a service started with --port 0."""
    print(f"LISTENING port={port}", file=sys.stdout, flush=True)


class ServiceShell:
    """A grpc.aio server serving `service_name` + grpc.health.v1 + reflection, drained on SIGTERM;
    Prometheus metrics on --metrics-port and the HTTP API (`http_app`) on --http-port when given."""

    def __init__(self, service_name: str, settings: ServiceSettings, metrics: ServiceMetrics | None = None) -> None:
        self.service_name = service_name
        self.settings = settings
        self.health = HealthStatus(service_name)
        self.lifecycle = Lifecycle(self.health, settings.drain_seconds)
        self.metrics = metrics or ServiceMetrics(settings.role)
        self.server: grpc.aio.Server = build_server()
        self.health.add_to(self.server)
        enable_reflection(self.server, [service_name])
        self.port = 0
        self.metrics_port: int | None = None
        self.http_app: Any = None  # the service's ASGI app, set before start()
        self.http: HttpServer | None = None
        self.http_port: int | None = None

    async def start(self) -> int:
        """Listen (NOT_SERVING until `set_ready(True)`) and return the bound port."""
        faults.warn_if_active()
        if self.settings.http_port is not None and self.http_app is not None:
            # Bound first: a taken HTTP port fails the start before gRPC listens.
            self.http = HttpServer(self.http_app, self.settings.host, self.settings.http_port)
        try:
            self.port = listen(self.server, self.settings.listen_address, self.settings.tls)
            await self.server.start()
            await self.health.start()
            if self.settings.metrics_port is not None:
                self.metrics_port = self.metrics.serve(self.settings.host, self.settings.metrics_port)
            if self.http is not None:
                self.http_port = await self.http.start()
        except BaseException:
            if self.http is not None:
                await self.http.stop()
            raise
        return self.port

    async def set_ready(self, ready: bool) -> None:
        await self.health.set_ready(ready)

    async def drain(
        self,
        on_draining: Callable[[], Awaitable[None]] | None = None,
        wait_idle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        try:
            await self.lifecycle.drain(self.server, on_draining, wait_idle)
        finally:
            # HTTP kept answering during the drain (new requests got 503); its in-flight
            # requests are the same domain work `wait_idle` waited for.
            if self.http is not None:
                await self.http.stop()

    def close(self) -> None:
        """After the drain: stop serving metrics."""
        self.metrics.close()

    async def run_until_signal(self, stop: Callable[[], Awaitable[None]]) -> None:
        """Announce the ports, wait for SIGTERM/SIGINT, then run `stop` (which drains)."""
        self.lifecycle.install_signal_handlers()
        if self.metrics_port is not None:
            announce_metrics_port(self.metrics_port)
        if self.http_port is not None:
            announce_http_port(self.http_port)
        announce_port(self.port)
        try:
            await self.lifecycle.wait_for_stop()
            await stop()
        finally:
            self.lifecycle.remove_signal_handlers()
