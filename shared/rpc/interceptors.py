"""Server interceptor: domain errors -> their gRPC status; anything else -> a generic INTERNAL.

An unhandled exception would otherwise reach the client as UNKNOWN carrying the exception text
(internal detail). Here it is logged with its traceback and a reference id, and the client gets
INTERNAL with that id only.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from shared.errors import ServiceError
from shared.rpc.status import to_grpc_status

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: BaseException, method: str) -> None:
    if isinstance(error, ServiceError):
        log.info("%s -> %s: %s", method, error.status, error.message)
        await context.abort_with_status(to_grpc_status(error))
    ref = uuid.uuid4().hex[:12]
    log.error("%s failed (ref %s)", method, ref, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (ref {ref}; details in the server log)")


def _passthrough(error: BaseException) -> bool:
    # Cancellation, and aborts the handler already chose, must travel untouched.
    return isinstance(error, (asyncio.CancelledError, grpc.aio.AbortError))


def _wrap_unary_response(behavior: Callable[..., Awaitable[Any]], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request_or_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await behavior(request_or_iterator, context)
        except BaseException as e:
            if _passthrough(e) or not isinstance(e, Exception):
                raise
            await _abort(context, e, method)

    return wrapped


def _wrap_stream_response(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def wrapped_gen(request_or_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            try:
                async for item in behavior(request_or_iterator, context):
                    yield item
            except BaseException as e:
                if _passthrough(e) or not isinstance(e, Exception):
                    raise
                await _abort(context, e, method)

        return wrapped_gen
    # A coroutine handler that writes with context.write().
    return _wrap_unary_response(behavior, method)


class ErrorToStatusInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        ser, de = handler.response_serializer, handler.request_deserializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary_response(handler.unary_unary, method), de, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream_response(handler.unary_stream, method), de, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary_response(handler.stream_unary, method), de, ser)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(_wrap_stream_response(handler.stream_stream, method), de, ser)
        return handler
