"""AsyncClient: Generate over a grpc.aio channel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from hybridpd_client.errors import GenerateError
from hybridpd_client.types import GenerateResult, TokenChunk, chunk_from, request_from, result_from
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.channel import CHANNEL_OPTIONS


class AsyncGenerateStream:
    """Token chunks as the service streams them; `result` once the stream has ended."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._replies: AsyncIterator[pb.GenerateResponse] = call.__aiter__()
        self._chunks: list[TokenChunk] = []
        self.result: GenerateResult | None = None
        self._cancelled = False

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> TokenChunk:
        while True:
            try:
                reply = await self._replies.__anext__()
            except grpc.RpcError as e:
                raise GenerateError.from_rpc(e) from None
            except asyncio.CancelledError:
                if not self._cancelled:
                    raise  # our task is being cancelled
                raise GenerateError("CANCELLED", "cancelled by this client") from None
            if reply.HasField("chunk"):
                chunk = chunk_from(reply.chunk)
                self._chunks.append(chunk)
                return chunk
            self.result = result_from(self._chunks, reply.summary)

    def cancel(self) -> None:
        """Stop the generation on the service (its blocks are freed there); iterating further
        raises GenerateError(CANCELLED)."""
        self._cancelled = True
        self._call.cancel()


class AsyncClient:
    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None, timeout: float | None = None) -> None:
        self.timeout = timeout
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        )
        self._stub = pb_grpc.DecodeServiceStub(self._channel)

    def stream(
        self, prompt: str | Sequence[int], max_tokens: int, *, request_id: str | None = None, timeout: float | None = None
    ) -> AsyncGenerateStream:
        call = self._stub.Generate(request_from(prompt, max_tokens, request_id), timeout=timeout or self.timeout)
        return AsyncGenerateStream(call)

    async def generate(
        self, prompt: str | Sequence[int], max_tokens: int, *, request_id: str | None = None, timeout: float | None = None
    ) -> GenerateResult:
        stream = self.stream(prompt, max_tokens, request_id=request_id, timeout=timeout)
        async for _ in stream:
            pass
        if stream.result is None:
            raise GenerateError("INTERNAL", "the stream ended without a summary")
        return stream.result

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.close()
