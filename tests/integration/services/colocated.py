"""The colocated baseline server of `bench e2e` (hybridpd_tools/bench/colocated_server.py) in this
process, on port 0: the same DecodeService.Generate API, one process, no transfer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from hybridpd_tools.bench.colocated_server import ColocatedServicer
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.server import build_server


@asynccontextmanager
async def colocated_port(servicer: ColocatedServicer) -> AsyncIterator[int]:
    server = build_server()
    pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(1.0)
        servicer.colocated.compute.shutdown(wait=True)
