"""Wiring of the prefill service: engine host, pins, servicer, gRPC shell; start and drain."""

from __future__ import annotations

import asyncio
import logging

from prefill_svc.boundary_cache import usable
from prefill_svc.http_api import PrefillHttp, advertised_address
from prefill_svc.pins import PinTable
from prefill_svc.servicer import PrefillServicer
from prefill_svc.session import SessionConfig
from shared.config import ServiceSettings
from shared.engine.reference import tokenizer as byte_tokenizer
from shared.http.app import ServiceInfo, build_app
from shared.http.chat_template import template_for
from shared.http.render import RenderRoutes
from shared.observe import Observer
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.service import ServiceShell
from shared.runtime.engine_host import EngineFactory, EngineHost
from shared.runtime.metrics import ServiceMetrics

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["PrefillService"].full_name


DEFAULT_BOUNDARY_SHARE = 0.25  # of the cache's blocks, for prefill's boundary cache


def boundary_blocks(settings: ServiceSettings, host: EngineHost) -> int:
    """--prefix-cache-blocks on prefill, else the default share where prefill runs chunked on an
    engine that resumes exactly (prefill_svc/boundary_cache.py)."""
    if settings.prefix_cache_blocks is not None:
        return settings.prefix_cache_blocks
    chunk = settings.prefill_chunk_tokens
    return int(host.num_blocks * DEFAULT_BOUNDARY_SHARE) if chunk > 0 and usable(host.engine, chunk) else 0


class PrefillApp:
    def __init__(self, settings: ServiceSettings, host: EngineHost, metrics: ServiceMetrics | None = None) -> None:
        self.settings = settings
        self.host = host
        self.shell = ServiceShell(SERVICE_NAME, settings, metrics)
        self.metrics = self.shell.metrics
        self._stopped = False
        self.pins = PinTable(host, settings.lease_seconds, Observer(self.metrics.telemetry))
        self.servicer = PrefillServicer(
            host,
            self.pins,
            self.shell.lifecycle,
            SessionConfig(
                heartbeat_seconds=settings.heartbeat_seconds,
                lease_seconds=settings.lease_seconds,
                max_pinned_requests=settings.max_pinned_requests,
                prefill_chunk_tokens=settings.prefill_chunk_tokens,
                max_batched_tokens=settings.max_batched_tokens,
                manifest_part_tokens=settings.manifest_part_tokens,
                layer_parts=settings.layer_parts,
                prefix_cache_blocks=boundary_blocks(settings, host),
            ),
            self.metrics,
        )
        pb_grpc.add_PrefillServiceServicer_to_server(self.servicer, self.shell.server)
        boundaries = self.servicer.runner.boundaries
        if boundaries.enabled:
            default = " (default share; --prefix-cache-blocks 0 turns it off)" if settings.prefix_cache_blocks is None else ""
            log.info(
                "prefix reuse: up to %d of %d blocks for chunk boundaries (every %d tokens)%s",
                boundaries.capacity_blocks,
                host.num_blocks,
                boundaries.chunk_tokens,
                default,
            )
        # /health, /metrics, /version, /v1/models, render, and the P/D prefill leg.
        http_info = ServiceInfo(
            "prefill", settings.model_names, lambda: self.shell.health.ready, self.metrics.registry, host.max_tokens
        )
        template = template_for(host.engine)
        # Text is encoded as decode encodes it: the checkpoint's tokenizer where the engine has one.
        own = host.engine.tokenizer
        encode = own.encode if own is not None else byte_tokenizer.encode
        render = RenderRoutes(http_info, encode, template)
        prefill_leg = PrefillHttp(
            http_info,
            host,
            self.servicer.handoffs,
            template,
            encode,
            lambda: advertised_address(settings.advertise_address, settings.host, self.port),
        )
        self.shell.http_app = build_app(http_info, [*prefill_leg.routes(), *render.routes()])
        self.metrics.watch_host(host)
        self.metrics.gauge("hybrid_pd_pinned_requests", "Requests whose blocks wait to be read", lambda: len(self.pins))
        self.metrics.gauge(
            "hybrid_pd_unclaimed_requests",
            "Requests prefilled by the HTTP prefill leg, not yet claimed by a decode engine",
            lambda: len(self.servicer.handoffs),
        )
        self.metrics.gauge("hybrid_pd_sessions", "Open Session streams", lambda: self.servicer.peers.open_sessions)
        self.metrics.gauge("hybrid_pd_decode_peers", "Handshaken decode engines with a session", lambda: len(self.servicer.peers))

    @classmethod
    async def start(cls, settings: ServiceSettings, engine_factory: EngineFactory) -> PrefillApp:
        """Memory, agents and a loopback self-READ first, then listen; SERVING once everything is up."""
        metrics = ServiceMetrics(settings.role)
        host = await EngineHost.start(settings, engine_factory, on_unknown_notif=metrics.unknown_notification)
        try:
            app = cls(settings, host, metrics)
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
            await self.shell.drain(wait_idle=self._idle)
        finally:
            await self.servicer.runner.aclose()
            await self.pins.aclose()
            await self.host.aclose()
            self.shell.close()

    async def _idle(self) -> None:
        """Until every session has ended (each ends once its jobs and pinned requests are done).
        Pins whose session is already gone do not hold the exit: nobody is left to release them."""
        while self.servicer.peers.open_sessions:
            await asyncio.sleep(0.02)
