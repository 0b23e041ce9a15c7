"""The gRPC shell around one service: server, health, reflection, listening, drain."""

from __future__ import annotations

import sys
from typing import Awaitable, Callable

import grpc

from shared.config import ServiceSettings
from shared.rpc.health import HealthStatus
from shared.rpc.lifecycle import Lifecycle
from shared.rpc.server import build_server, enable_reflection, listen


def announce_port(port: int) -> None:
    """The one stdout line scripts parse to find a service started with --port 0."""
    print(f"LISTENING port={port}", file=sys.stdout, flush=True)


class ServiceShell:
    """A grpc.aio server serving `service_name` + grpc.health.v1 + reflection, drained on SIGTERM."""

    def __init__(self, service_name: str, settings: ServiceSettings) -> None:
        self.service_name = service_name
        self.settings = settings
        self.health = HealthStatus(service_name)
        self.lifecycle = Lifecycle(self.health, settings.drain_seconds)
        self.server: grpc.aio.Server = build_server()
        self.health.add_to(self.server)
        enable_reflection(self.server, [service_name])
        self.port = 0

    async def start(self) -> int:
        """Listen (NOT_SERVING until `set_ready(True)`) and return the bound port."""
        self.port = listen(self.server, self.settings.listen_address, self.settings.tls)
        await self.server.start()
        await self.health.start()
        return self.port

    async def set_ready(self, ready: bool) -> None:
        await self.health.set_ready(ready)

    async def drain(self, on_draining: Callable[[], Awaitable[None]] | None = None) -> None:
        await self.lifecycle.drain(self.server, on_draining)

    async def run_until_signal(self, stop: Callable[[], Awaitable[None]]) -> None:
        """Announce the port, wait for SIGTERM/SIGINT, then run `stop` (which drains)."""
        self.lifecycle.install_signal_handlers()
        announce_port(self.port)
        try:
            await self.lifecycle.wait_for_stop()
            await stop()
        finally:
            self.lifecycle.remove_signal_handlers()
