"""Wiring of the decode service: engine host, prefill peers, servicer, gRPC shell; start and drain.

Readiness (health SERVING) needs the local engine up (agents, registered memory, a loopback
self-READ) and, at start, at least one prefill peer handshaken, probe-READ and with an open
Session. With --local-prefill off it follows the peers as they come and go; by default
(fallback) it stays SERVING once a peer was ready, since decode then computes prompts itself
while none is. Started without --prefill (serving the decode legs of a P/D router, whose
requests name their prefill engine, and computing plain requests itself), the engine alone
decides readiness. Liveness (service "") does not depend on peers.
"""

from __future__ import annotations

import asyncio
import logging

from decode_svc.discovery import Discovery
from decode_svc.http_api import DecodeHttp
from decode_svc.learned_peers import LearnedPeers
from decode_svc.prefill_peer import PrefillPeer, PrefillPeers
from decode_svc.reuse import reuse_sizes
from decode_svc.servicer import DecodeServicer
from shared.config import ServiceSettings
from shared.http.app import ServiceInfo, build_app
from shared.http.chat_template import template_for
from shared.http.render import RenderRoutes
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.service import ServiceShell
from shared.runtime.engine_host import EngineFactory, EngineHost
from shared.runtime.metrics import ServiceMetrics

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["DecodeService"].full_name


class DecodeApp:
    def __init__(self, settings: ServiceSettings, host: EngineHost, metrics: ServiceMetrics | None = None) -> None:
        self.settings = settings
        self.host = host
        self.shell = ServiceShell(SERVICE_NAME, settings, metrics)
        self.metrics = self.shell.metrics
        self._stopped = False
        self._health_updates: set[asyncio.Future[None]] = set()
        self._was_ready = False  # a prefill peer has been ready (readiness with --local-prefill fallback)
        self.peers = PrefillPeers([], self._new_peer, configured=bool(settings.prefill))
        # Prefill engines named by the requests' kv_transfer_params (P/D decode legs).
        self.learned = LearnedPeers(self.peers, lambda target: self._new_peer(target, None, once=True))
        # --prefill names resolve to the peers (one per address), re-resolved every --discovery-seconds.
        self.discovery = Discovery(settings.prefill, self.peers, settings.discovery_seconds)
        prefix_blocks, prefix_states = reuse_sizes(settings.prefix_cache_blocks, settings.prefix_cache_states, host)
        if prefix_blocks:
            default = " (default share; --prefix-cache-blocks 0 turns it off)" if settings.prefix_cache_blocks is None else ""
            log.info(
                "prefix reuse: up to %d of %d blocks for prompts' K/V, %d state checkpoints%s",
                prefix_blocks,
                host.num_blocks,
                prefix_states,
                default,
            )
        self.servicer = DecodeServicer(
            host,
            self.peers,
            self.shell.lifecycle,
            check_state=settings.check_state,
            read_timeout=settings.read_timeout_seconds,
            manifest_parts=settings.manifest_parts,
            metrics=self.metrics,
            learned=self.learned,
            prefix_cache_blocks=prefix_blocks,
            prefix_cache_states=prefix_states,
            local_prefill=settings.local_prefill,
            local_prefill_below=settings.local_prefill_below,
            local_prefill_queue_tokens=settings.local_prefill_queue_tokens,
            stream_interval=settings.stream_interval,
            max_batched_tokens=settings.max_batched_tokens,
        )
        pb_grpc.add_DecodeServiceServicer_to_server(self.servicer, self.shell.server)
        http_info = ServiceInfo(
            "decode", settings.model_names, lambda: self.shell.health.ready, self.metrics.registry, host.max_tokens
        )
        self.http_api = DecodeHttp(self.servicer, host, http_info, template_for(host.engine))
        render = RenderRoutes(http_info, self.http_api.tokenizer.encode, self.http_api.template)
        self.shell.http_app = build_app(http_info, [*self.http_api.routes(), *render.routes()])
        self.metrics.watch_host(host)
        self.metrics.gauge(
            "hybrid_pd_prefill_peers_ready",
            "Prefill peers handshaken with an open session",
            lambda: sum(p.ready for p in self.peers.peers),
        )
        self.metrics.gauge(
            "hybrid_pd_requests_in_flight", "Generate calls in progress", lambda: self.servicer.generation.in_flight
        )
        self.metrics.gauge(
            "hybrid_pd_remote_agents",
            "Remote NIXL agents loaded (dropped when a peer is lost)",
            lambda: self.peers.remote_agents + self.learned.remote_agents,
        )

    @classmethod
    async def start(cls, settings: ServiceSettings, engine_factory: EngineFactory) -> DecodeApp:
        """Memory, agents and a loopback self-READ first, then listen; SERVING once a prefill peer is ready."""
        metrics = ServiceMetrics(settings.role)
        host = await EngineHost.start(settings, engine_factory, on_unknown_notif=metrics.unknown_notification)
        try:
            app = cls(settings, host, metrics)
            await app.shell.start()
        except BaseException:
            await host.aclose()
            raise
        app.peers.start()
        await app.discovery.start()
        if not settings.prefill:
            await app.shell.set_ready(True)
        log.info(
            "decode engine %s listening on port %d, prefill peers %s",
            settings.engine_id,
            app.port,
            ", ".join(settings.prefill) or "none (P/D decode legs only: requests name their prefill engine)",
        )
        return app

    def _new_peer(self, target: str, server_name: str | None, *, once: bool = False) -> PrefillPeer:
        return PrefillPeer(
            target,
            self.host,
            self.settings.tls,
            self._on_peer_change,
            max_pinned_requests=self.settings.max_pinned_requests,
            server_name=server_name,
            reconnect_max_seconds=self.settings.reconnect_max_seconds,
            once=once,
        )

    @property
    def port(self) -> int:
        return self.shell.port

    async def wait_ready(self, timeout: float) -> None:
        """Until at least one prefill peer is ready (tests and scripts)."""
        async with asyncio.timeout(timeout):
            while not self.peers.any_ready:
                await asyncio.sleep(0.02)

    async def _idle(self) -> None:
        """Until every Generate in flight has ended."""
        while self.servicer.generation.in_flight:
            await asyncio.sleep(0.02)

    def _on_peer_change(self) -> None:
        if not self.settings.prefill:
            return  # readiness is the engine's alone (learned peers come and go with requests)
        ready = self.peers.any_ready
        if self.settings.local_prefill != "off":  # fallback or share: both compute when no prefill is ready
            # Once a prefill engine was ready, decode computes prompts itself while none is:
            # losing every prefill engine then slows requests down instead of taking decode out.
            self._was_ready = self._was_ready or ready
            ready = self._was_ready
        update = asyncio.ensure_future(self.shell.set_ready(ready))
        self._health_updates.add(update)
        update.add_done_callback(self._health_updates.discard)

    async def stop(self) -> None:
        """Drain: NOT_SERVING, refuse new Generates, let in-flight ones finish, then close peers."""
        if self._stopped:
            return
        self._stopped = True
        try:
            await self.shell.drain(wait_idle=self._idle)
        finally:
            await self.discovery.aclose()
            await self.learned.aclose()
            await self.peers.aclose()
            await self.servicer.generation.aclose()
            await self.host.aclose()
            self.shell.close()
