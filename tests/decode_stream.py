"""One Generate call of the decode service read to its end: the tests' one loop over the stream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc


@dataclass
class Streamed:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    summary: dpb.GenerateSummary | None = None  # None: the stream ended without one

    def summary_or_empty(self) -> dpb.GenerateSummary:
        return self.summary if self.summary is not None else dpb.GenerateSummary()


async def stream(
    target: grpc.aio.Channel | dpb_grpc.DecodeServiceStub,
    request: dpb.GenerateRequest,
    *,
    timeout: float,
    metadata: Sequence[tuple[str, str]] = (),
    into: Streamed | None = None,
) -> Streamed:
    """Every chunk's tokens and text, and the summary. A failed call raises its AioRpcError;
    what arrived before it stays in `into`, when given."""
    out = into if into is not None else Streamed()
    stub = target if isinstance(target, dpb_grpc.DecodeServiceStub) else dpb_grpc.DecodeServiceStub(target)
    async for reply in stub.Generate(request, timeout=timeout, metadata=tuple(metadata)):
        if reply.HasField("chunk"):
            out.tokens += reply.chunk.token_ids
            out.text += reply.chunk.text
        else:
            out.summary = reply.summary
    return out
