"""Wiring of the prefill service: engine host, pins, servicer, gRPC shell; start and drain."""

from __future__ import annotations

import logging

from shared.config import ServiceSettings
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.engine_host import EngineFactory, EngineHost
from shared.rpc.service import ServiceShell
from prefill_svc.pins import PinTable
from prefill_svc.servicer import PrefillServicer
from prefill_svc.session import SessionConfig

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillApp:
    def __init__(self, settings: ServiceSettings, host: EngineHost) -> None:
        self.settings = settings
        self.host = host
        self.shell = ServiceShell(SERVICE_NAME, settings)
        self._stopped = False
        self.pins = PinTable(host, settings.lease_seconds)
        self.servicer = PrefillServicer(
            host,
            self.pins,
            self.shell.lifecycle,
            SessionConfig(heartbeat_seconds=settings.heartbeat_seconds, lease_seconds=settings.lease_seconds),
        )
        pb_grpc.add_PrefillServiceServicer_to_server(self.servicer, self.shell.server)

    @classmethod
    async def start(cls, settings: ServiceSettings, engine_factory: EngineFactory) -> PrefillApp:
        """Memory and agents first, then listen; SERVING once everything is up."""
        host = await EngineHost.start(settings, engine_factory)
        try:
            app = cls(settings, host)
            await app.shell.start()
        except BaseException:
            await host.aclose()
            raise
        await app.shell.set_ready(True)
        log.info("prefill engine %s serving on port %d", settings.engine_id, app.port)
        return app

    @property
    def port(self) -> int:
        return self.shell.port

    async def stop(self) -> None:
        """Drain (NOT_SERVING, refuse new work, let sessions finish within the grace), then free everything."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.shell.drain()
        finally:
            await self.pins.aclose()
            await self.host.aclose()
