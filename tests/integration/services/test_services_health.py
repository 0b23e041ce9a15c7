"""grpc.health.v1 per service (NOT_SERVING until ready) and server reflection."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.status import describe

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]

PREFILL = "hybridpd.v1.PrefillService"
DECODE = "hybridpd.v1.DecodeService"


async def health(channel: grpc.aio.Channel, service: str) -> str:
    try:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    except grpc.aio.AioRpcError as e:
        return str(e.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


async def test_health_follows_readiness(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    p = channel_to(prefill.port)
    assert await health(p, PREFILL) == "SERVING"
    assert await health(p, "") == "SERVING"
    assert await health(p, DECODE) == "NOT_FOUND"

    decode = await start_decode(prefill.port, "--local-prefill", "off")
    d = channel_to(decode.port)
    assert await health(d, DECODE) == "SERVING"

    # Without the fallback decode readiness needs a reachable prefill: take it away.
    await prefill.stop()
    for _ in range(300):
        if await health(d, DECODE) == "NOT_SERVING":
            break
        await asyncio.sleep(0.02)
    assert await health(d, DECODE) == "NOT_SERVING"
    assert await health(d, "") == "SERVING"  # liveness does not depend on peers


async def test_decode_without_prefill_is_not_serving(start_decode: Any, channel_to: Any) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    decode = await start_decode(dead_port, "--local-prefill", "off", ready=False)
    assert await health(channel_to(decode.port), DECODE) == "NOT_SERVING"
    # With it (the default) too: readiness waits for a first prefill peer at start.
    fallback = await start_decode(dead_port, ready=False)
    assert await health(channel_to(fallback.port), DECODE) == "NOT_SERVING"


async def test_drain_goes_not_serving_and_refuses_new_work(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    p = channel_to(prefill.port)
    await prefill.shell.lifecycle.health.shutdown()
    prefill.shell.lifecycle.draining.set()
    assert await health(p, PREFILL) == "NOT_SERVING"
    assert await health(p, "") == "NOT_SERVING"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pb_grpc.PrefillServiceStub(p).Handshake(pb.HandshakeRequest(layout=prefill.host.message), timeout=5)
    failure = describe(err.value)
    assert failure.status == "UNAVAILABLE" and failure.reason == "DRAINING"


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_reflection_lists_services(start_prefill: Any, start_decode: Any, channel_to: Any, role: str) -> None:
    prefill = await start_prefill()
    port = prefill.port if role == "prefill" else (await start_decode(prefill.port, ready=False)).port
    sync_channel = grpc.insecure_channel(f"127.0.0.1:{port}")  # the reflection client is synchronous
    try:
        db = ProtoReflectionDescriptorDatabase(sync_channel)
        services = set(await asyncio.to_thread(db.get_services))
        own = PREFILL if role == "prefill" else DECODE
        assert {own, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        pool = DescriptorPool(db)
        service = await asyncio.to_thread(pool.FindServiceByName, own)
        methods = {m.name for m in service.methods}
        assert methods == ({"Handshake", "Session"} if role == "prefill" else {"Generate", "GetLayout"})
    finally:
        sync_channel.close()
