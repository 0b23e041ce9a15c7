"""grpc.health.v1 for one service: NOT_SERVING until the service says it is ready.

The empty service name "" stays SERVING while the process runs (liveness); the named service
(readiness) starts NOT_SERVING, follows `set_ready`, and drops to NOT_SERVING for good when the
drain starts.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthStatus:
    def __init__(self, service_name: str) -> None:
        self.service_name = service_name
        self.servicer = health.aio.HealthServicer()
        self.ready = False

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        await self.servicer.set("", SERVING)
        await self.servicer.set(self.service_name, NOT_SERVING)

    async def set_ready(self, ready: bool) -> None:
        self.ready = ready
        await self.servicer.set(self.service_name, SERVING if ready else NOT_SERVING)

    async def shutdown(self) -> None:
        """Permanently NOT_SERVING, every name, watchers told at once."""
        self.ready = False
        await self.servicer.enter_graceful_shutdown()
