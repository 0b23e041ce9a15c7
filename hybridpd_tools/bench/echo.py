"""The floor of a Session-stream exchange: one message out and one back over a grpc.aio
bidirectional stream on loopback, server and client in this process (as `bench control` runs
the services), with the same server options as the services and no handler work at all."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from shared.rpc.server import SERVER_OPTIONS

_METHOD = "/hybridpd.bench.Echo/Stream"


def _identity(b: bytes) -> bytes:
    return b


async def _echo(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message


async def echo_round_trips(count: int, payload: bytes = b"x" * 64) -> list[float]:
    """Seconds per round trip, `count` of them, on one stream."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.stream_stream_rpc_method_handler(_echo, request_deserializer=_identity, response_serializer=_identity)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("hybridpd.bench.Echo", {"Stream": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    times: list[float] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(_METHOD, request_serializer=_identity, response_deserializer=_identity)()
            for _ in range(count):
                started = time.perf_counter()
                await call.write(payload)
                await call.read()
                times.append(time.perf_counter() - started)
            await call.done_writing()
    finally:
        await server.stop(None)
    return times
