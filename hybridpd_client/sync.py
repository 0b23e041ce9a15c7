"""Client: Generate over a blocking grpc channel (no event loop needed)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from hybridpd_client.errors import GenerateError
from hybridpd_client.types import GenerateResult, TokenChunk, chunk_from, request_from, result_from
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.channel import CHANNEL_OPTIONS


class GenerateStream:
    """Token chunks as the service streams them; `result` once the stream has ended."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._chunks: list[TokenChunk] = []
        self.result: GenerateResult | None = None

    def __iter__(self) -> Iterator[TokenChunk]:
        replies: Iterator[pb.GenerateResponse] = self._call
        try:
            for reply in replies:
                if reply.HasField("chunk"):
                    chunk = chunk_from(reply.chunk)
                    self._chunks.append(chunk)
                    yield chunk
                else:
                    self.result = result_from(self._chunks, reply.summary)
        except grpc.RpcError as e:
            raise GenerateError.from_rpc(e) from None

    def cancel(self) -> None:
        """Stop the generation on the service (its blocks are freed there)."""
        self._call.cancel()


class Client:
    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None, timeout: float | None = None) -> None:
        self.timeout = timeout
        self._channel = (
            grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
            if credentials is not None
            else grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        )
        self._stub = pb_grpc.DecodeServiceStub(self._channel)

    def stream(
        self, prompt: str | Sequence[int], max_tokens: int, *, request_id: str | None = None, timeout: float | None = None
    ) -> GenerateStream:
        call = self._stub.Generate(request_from(prompt, max_tokens, request_id), timeout=timeout or self.timeout)
        return GenerateStream(call)

    def generate(
        self, prompt: str | Sequence[int], max_tokens: int, *, request_id: str | None = None, timeout: float | None = None
    ) -> GenerateResult:
        stream = self.stream(prompt, max_tokens, request_id=request_id, timeout=timeout)
        for _ in stream:
            pass
        if stream.result is None:
            raise GenerateError("INTERNAL", "the stream ended without a summary")
        return stream.result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
