"""DecodeService handlers: thin proto <-> domain adapters (and the request counter by status)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from decode_svc.generation import Generation
from decode_svc.prefill_peer import PrefillPeers
from shared.config import DEFAULT_READ_TIMEOUT_SECONDS
from shared.errors import ServiceError
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.lifecycle import Lifecycle
from shared.rpc.metrics import ServiceMetrics
from shared.runtime.engine_host import EngineHost


@dataclass
class EarlyStop:
    """Set `stopped` before closing `generate()` when the output is complete (not a cancel)."""

    stopped: bool = False


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(
        self,
        host: EngineHost,
        peers: PrefillPeers,
        lifecycle: Lifecycle,
        *,
        check_state: bool,
        read_timeout: float = DEFAULT_READ_TIMEOUT_SECONDS,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.host = host
        self.peers = peers
        self.lifecycle = lifecycle
        self.metrics = metrics or ServiceMetrics("decode")
        self.generation = Generation(
            host, peers, check_state=check_state, read_timeout=read_timeout, telemetry=self.metrics.telemetry
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        # aclosing: a call cancelled while this handler waits at its yield ends the generation now.
        async with contextlib.aclosing(self.generate(request, context.time_remaining())) as responses:
            async for response in responses:
                yield response

    async def generate(
        self, request: pb.GenerateRequest, time_remaining: float | None, early_stop: EarlyStop | None = None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The one entry both front doors (gRPC Generate and the HTTP API) call: refused while
        draining, counted by final status. A consumer that closes this generator early counts as
        CANCELLED, unless it set `early_stop.stopped` first (an HTTP stop sequence matched)."""
        status = "INTERNAL"
        try:
            self.lifecycle.check_accepting("new requests")
            async for response in self.generation.run(request, time_remaining):
                yield response
            status = "OK"
        except GeneratorExit:
            status = "OK" if early_stop is not None and early_stop.stopped else "CANCELLED"
            raise
        except ServiceError as e:
            status = e.status
            if e.reason != e.default_reason:
                self.metrics.telemetry.failures.labels(reason=e.reason).inc()
            raise
        except asyncio.CancelledError:
            status = "CANCELLED"  # the client went away or its deadline passed
            raise
        finally:
            self.metrics.telemetry.requests.labels(status=status).inc()

    async def GetLayout(self, request: pb.GetLayoutRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.GetLayoutResponse:
        return pb.GetLayoutResponse(layout=self.host.message, peers=[p.status() for p in self.peers.peers])
