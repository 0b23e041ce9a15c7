"""The event loop stays responsive during a large DRAM READ: a gRPC health check on a real
grpc.aio server in the same process is answered while a 256 MiB READ is in flight (on DRAM,
NIXL copies inside `transfer()`, which therefore runs on the agent's owner thread)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.mark.asyncio
async def test_health_check_answered_while_a_256_mib_read_is_in_flight(
    spawn_target: Callable[..., Any], make_initiator: Callable[..., Any]
) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        blocks, page = 64, 4 << 20  # 256 MiB
        target = await spawn_target(num_blocks=blocks, page_bytes=page, seed=5)
        initiator = await make_initiator(num_blocks=blocks, page_bytes=page)
        _, local, remote = await initiator.connect(target)
        await initiator.poller.read(initiator.agent, local, [0], remote, [0], b"wire-up", timeout=5)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # connected before the READ
            read = asyncio.ensure_future(
                initiator.poller.read(initiator.agent, local, np.arange(blocks), remote, np.arange(blocks), b"big", timeout=20)
            )
            answered: list[float] = []
            while not read.done():
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                if not read.done():
                    answered.append(time.perf_counter())
            result = await read
        assert result.nbytes == 256 << 20
        assert answered, "no health check was answered while the 256 MiB READ was in flight"
    finally:
        await server.stop(None)
