"""One Generate call of the decode service read to its end: the tests' one loop over the stream,
and the shapes the tests read it in (tokens and summary, how it ended, or both without raising)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.rpc.status import RpcFailure, describe

# A channel, a stub, or an address (a channel of the call's own, closed after it).
Target = grpc.aio.Channel | dpb_grpc.DecodeServiceStub | str


@dataclass
class Streamed:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    summary: dpb.GenerateSummary | None = None  # None: the stream ended without one

    def summary_or_empty(self) -> dpb.GenerateSummary:
        return self.summary if self.summary is not None else dpb.GenerateSummary()


async def stream(
    target: Target,
    request: dpb.GenerateRequest,
    *,
    timeout: float,
    metadata: Sequence[tuple[str, str]] = (),
    into: Streamed | None = None,
) -> Streamed:
    """Every chunk's tokens and text, and the summary. A failed call raises its AioRpcError;
    what arrived before it stays in `into`, when given."""
    out = into if into is not None else Streamed()
    if isinstance(target, str):
        async with grpc.aio.insecure_channel(target) as channel:
            return await stream(channel, request, timeout=timeout, metadata=metadata, into=out)
    stub = target if isinstance(target, dpb_grpc.DecodeServiceStub) else dpb_grpc.DecodeServiceStub(target)
    async for reply in stub.Generate(request, timeout=timeout, metadata=tuple(metadata)):
        if reply.HasField("chunk"):
            out.tokens += reply.chunk.token_ids
            out.text += reply.chunk.text
        else:
            out.summary = reply.summary
    return out


async def generated(
    target: Target, request: dpb.GenerateRequest, *, timeout: float, metadata: Sequence[tuple[str, str]] = ()
) -> tuple[list[int], dpb.GenerateSummary]:
    """The tokens and the summary (an empty one when the stream ended without); a failed call raises."""
    got = await stream(target, request, timeout=timeout, metadata=metadata)
    return got.tokens, got.summary_or_empty()


async def status_of(
    target: Target, request: dpb.GenerateRequest, *, timeout: float, metadata: Sequence[tuple[str, str]] = ()
) -> grpc.StatusCode:
    """How the call ended: OK, or the failed call's code."""
    try:
        await stream(target, request, timeout=timeout, metadata=metadata)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@dataclass
class Settled(Streamed):
    failure: RpcFailure | None = None  # None: the call succeeded


async def settled(target: Target, request: dpb.GenerateRequest, *, timeout: float) -> Settled:
    """What arrived and how the call ended; never raises for a failed call."""
    got = Settled()
    try:
        await stream(target, request, timeout=timeout, into=got)
    except grpc.aio.AioRpcError as e:
        got.failure = describe(e)
    return got


async def failure_of(target: Target, request: dpb.GenerateRequest, *, timeout: float) -> RpcFailure:
    """How the call failed; a call that succeeds fails the test."""
    got = await settled(target, request, timeout=timeout)
    assert got.failure is not None, f"the call succeeded: {got}"
    return got.failure
