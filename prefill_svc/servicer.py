"""PrefillService handlers: thin proto <-> domain adapters over the job runner and pins."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from prefill_svc.handoff import Handoffs
from prefill_svc.jobs import JobRunner
from prefill_svc.load import LoadBoard
from prefill_svc.peers import DecodePeers
from prefill_svc.pins import PinTable
from prefill_svc.session import PrefillSession, SessionConfig
from shared.errors import InvalidArgument, ServiceError
from shared.observe import Count, Observer
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.compat import check_pair
from shared.rpc.lifecycle import Lifecycle
from shared.runtime.engine_host import EngineHost
from shared.runtime.metrics import ServiceMetrics

log = logging.getLogger(__name__)


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(
        self,
        host: EngineHost,
        pins: PinTable,
        lifecycle: Lifecycle,
        config: SessionConfig,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.host = host
        self.pins = pins
        self.lifecycle = lifecycle
        self.config = config
        self.metrics = metrics or ServiceMetrics("prefill")
        self.observer = Observer(self.metrics.telemetry)
        self.peers = DecodePeers()
        self.runner = JobRunner(
            host,
            pins,
            config.prefill_chunk_tokens,
            config.manifest_part_tokens,
            config.layer_parts,
            config.max_batched_tokens,
            config.prefix_cache_blocks,
            self.observer,
        )
        if self.runner.steps is not None:
            self.runner.steps.observer = self.observer
        self.load = LoadBoard(pins)  # what every session reports to its decode engine
        self.handoffs = Handoffs(self.runner, pins)  # requests the HTTP prefill leg pinned for a decode engine to claim

    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.HandshakeResponse:
        self.lifecycle.check_accepting("new handshakes")
        try:
            if not request.HasField("layout"):
                raise InvalidArgument("the decode engine's layout is required", field="layout")
            check_pair(
                self.host.message, request.layout, local_role="prefill", local_layout=self.host.layout, spec=self.host.spec
            )
        except ServiceError as e:
            self.observer.count(Count.HANDSHAKE, kind=e.status.lower())
            raise
        self.observer.count(Count.HANDSHAKE, kind="ok")
        peer = self.peers.add(request.layout)
        for agent in self.host.agents:  # its probe READ follows: answer its wire-up at once
            agent.wake()
        log.info("handshake with decode engine %s (tp %d) accepted", peer.engine_id, request.layout.tp_size)
        return pb.HandshakeResponse(layout=self.host.message)

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.SessionResponse]:
        session = PrefillSession(
            host=self.host,
            pins=self.pins,
            peers=self.peers,
            runner=self.runner,
            lifecycle=self.lifecycle,
            config=self.config,
            handoffs=self.handoffs,
            load=self.load,
        )
        async for response in session.stream(request_iterator):
            yield response
