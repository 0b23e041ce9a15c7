"""The interceptor: domain errors -> their status with named fields; anything else -> INTERNAL
without leaking the exception text. Real grpc.aio server on port 0."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from shared.errors import FieldIssue, IncompatibleLayout, InvalidArgument, ResourceExhausted
from shared.rpc.server import build_server
from shared.rpc.status import describe

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

RAISES: dict[str, BaseException] = {
    "invalid": InvalidArgument("must be >= 1, got 0", field="max_tokens"),
    "incompatible": IncompatibleLayout(
        "2 fields differ", issues=[FieldIssue("model.kv_dtype", "bf16 vs fp8"), FieldIssue("conv_layout", "sd")]
    ),
    "full": ResourceExhausted("cache full", reason="CACHE_FULL"),
    "bug": ValueError("secret internal detail"),
}


async def _unary_handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise RAISES[request.decode()]


async def _stream_handler(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    raise RAISES[request.decode()]


@pytest_asyncio.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = build_server()
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary_handler),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream_handler),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Errors", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
    await server.stop(None)


async def call_unary(channel: grpc.aio.Channel, what: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await channel.unary_unary("/test.Errors/Unary")(what.encode(), timeout=5)
    return err.value


async def test_invalid_argument_names_the_field(channel: grpc.aio.Channel) -> None:
    failure = describe(await call_unary(channel, "invalid"))
    assert failure.status == "INVALID_ARGUMENT"
    assert failure.message == "max_tokens: must be >= 1, got 0"
    assert failure.fields == ("max_tokens",)
    assert failure.reason == "INVALID_ARGUMENT"


async def test_failed_precondition_lists_every_field(channel: grpc.aio.Channel) -> None:
    failure = describe(await call_unary(channel, "incompatible"))
    assert failure.status == "FAILED_PRECONDITION"
    assert failure.reason == "INCOMPATIBLE_LAYOUT"
    assert failure.fields == ("model.kv_dtype", "conv_layout")


async def test_retryable_error_keeps_its_reason(channel: grpc.aio.Channel) -> None:
    failure = describe(await call_unary(channel, "full"))
    assert (failure.status, failure.reason) == ("RESOURCE_EXHAUSTED", "CACHE_FULL")


async def test_unexpected_exception_is_internal_and_leaks_nothing(channel: grpc.aio.Channel) -> None:
    error = await call_unary(channel, "bug")
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in (error.details() or "") and "ValueError" not in (error.details() or "")
    assert "ref " in (error.details() or "")


async def test_streaming_error_after_first_message(channel: grpc.aio.Channel) -> None:
    call = channel.unary_stream("/test.Errors/Stream")(b"invalid", timeout=5)
    assert await call.read() == b"first"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert describe(err.value).fields == ("max_tokens",)
