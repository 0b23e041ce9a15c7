"""A Generate client that timestamps what it receives (time to first token, inter-token latency).

Times are taken when each chunk arrives at the client, so they include the gRPC stream. The
first chunk carries the first token alone (the services send it at once); later chunks carry
several tokens, so the inter-token latency is the mean gap: (last - first) / (tokens - 1).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc


@dataclass
class Timed:
    sent: float
    token_ids: list[int] = field(default_factory=list)
    first_token: float | None = None
    last_token: float | None = None
    done: float = math.nan
    summary: Any = None  # pb.GenerateSummary
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent if self.first_token is not None else math.nan

    @property
    def itl(self) -> float:
        n = len(self.token_ids)
        if self.first_token is None or self.last_token is None or n < 2:
            return math.nan
        return (self.last_token - self.first_token) / (n - 1)


def seconds(duration: Any) -> float:
    """A google.protobuf.Duration in seconds."""
    return float(duration.seconds) + float(duration.nanos) / 1e9


async def generate(
    stub: pb_grpc.DecodeServiceAsyncStub,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    request_id: str = "",
    timeout: float = 600.0,
    ignore_eos: bool = False,
) -> Timed:
    result = Timed(sent=time.perf_counter())
    request = pb.GenerateRequest(
        prompt_token_ids=list(prompt), max_tokens=max_tokens, request_id=request_id, ignore_eos=ignore_eos
    )
    try:
        async for reply in stub.Generate(request, timeout=timeout):
            now = time.perf_counter()
            if reply.HasField("chunk"):
                if reply.chunk.token_ids:
                    if result.first_token is None:
                        result.first_token = now
                    result.last_token = now
                    result.token_ids.extend(reply.chunk.token_ids)
            else:
                result.summary = reply.summary
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    result.done = time.perf_counter()
    return result
