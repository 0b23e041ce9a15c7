"""Wiring of the decode service: engine host, prefill peers, servicer, gRPC shell; start and drain.

Readiness (health SERVING) needs the local engine up and at least one prefill peer handshaken
with an open Session; it follows the peers as they come and go.
"""

from __future__ import annotations

import asyncio
import logging

from shared.config import ServiceSettings
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.engine_host import EngineFactory, EngineHost
from shared.rpc.service import ServiceShell
from decode_svc.prefill_peer import PrefillPeer, PrefillPeers
from decode_svc.servicer import DecodeServicer

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["DecodeService"].full_name


class DecodeApp:
    def __init__(self, settings: ServiceSettings, host: EngineHost) -> None:
        self.settings = settings
        self.host = host
        self.shell = ServiceShell(SERVICE_NAME, settings)
        self._stopped = False
        self._health_updates: set[asyncio.Future[None]] = set()
        self.peers = PrefillPeers(
            [PrefillPeer(target, host, settings.tls, self._on_peer_change) for target in settings.prefill]
        )
        self.servicer = DecodeServicer(host, self.peers, self.shell.lifecycle, check_state=settings.check_state)
        pb_grpc.add_DecodeServiceServicer_to_server(self.servicer, self.shell.server)

    @classmethod
    async def start(cls, settings: ServiceSettings, engine_factory: EngineFactory) -> DecodeApp:
        host = await EngineHost.start(settings, engine_factory)
        try:
            app = cls(settings, host)
            await app.shell.start()
        except BaseException:
            await host.aclose()
            raise
        app.peers.start()
        log.info("decode engine %s listening on port %d, prefill peers %s", settings.engine_id, app.port, ", ".join(settings.prefill))
        return app

    @property
    def port(self) -> int:
        return self.shell.port

    async def wait_ready(self, timeout: float) -> None:
        """Until at least one prefill peer is ready (tests and scripts)."""
        async with asyncio.timeout(timeout):
            while not self.peers.any_ready:
                await asyncio.sleep(0.02)

    def _on_peer_change(self) -> None:
        update = asyncio.ensure_future(self.shell.set_ready(self.peers.any_ready))
        self._health_updates.add(update)
        update.add_done_callback(self._health_updates.discard)

    async def stop(self) -> None:
        """Drain: NOT_SERVING, refuse new Generates, let in-flight ones finish, then close peers."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.shell.drain()
        finally:
            await self.peers.aclose()
            await self.host.aclose()
