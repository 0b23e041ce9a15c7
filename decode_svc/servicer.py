"""DecodeService handlers: thin proto <-> domain adapters."""

from __future__ import annotations

from typing import Any, AsyncIterator

import grpc

from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.engine_host import EngineHost
from shared.rpc.lifecycle import Lifecycle
from decode_svc.generation import Generation
from decode_svc.prefill_peer import PrefillPeers


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, host: EngineHost, peers: PrefillPeers, lifecycle: Lifecycle, *, check_state: bool) -> None:
        self.host = host
        self.peers = peers
        self.lifecycle = lifecycle
        self.generation = Generation(host, peers, check_state=check_state)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.lifecycle.check_accepting("new requests")
        async for response in self.generation.run(request, context.time_remaining()):
            yield response

    async def GetLayout(self, request: pb.GetLayoutRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.GetLayoutResponse:
        return pb.GetLayoutResponse(layout=self.host.message, peers=[p.status() for p in self.peers.peers])
