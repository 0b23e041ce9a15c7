"""Typed results of a Generate call (plain dataclasses; no protobuf types leak to users)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared import limits
from shared.limits import IntRange
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc.proto_time import seconds


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class TransferStats:
    attention_bytes: int
    conv_bytes: int
    ssm_bytes: int
    total_bytes: int
    read_count: int
    descriptor_count: int


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    prompt_token_count: int
    generated_token_count: int
    num_transferred_tokens: int
    finish_reason: str  # "length"
    prefill_engine_id: str
    prefill_target: str
    transfer: TransferStats
    prefill_seconds: float
    read_seconds: float
    time_to_first_token_seconds: float
    total_seconds: float
    state_verified: bool


def chunk_from(message: pb.TokenChunk) -> TokenChunk:
    return TokenChunk(tuple(message.token_ids), message.text)


MAX_TOKENS_WIRE = limits.wire_range(pb.GenerateRequest.DESCRIPTOR, "max_tokens")  # 0 goes through: the server says why not


def _check(value: object, limit: IntRange, name: str) -> None:
    """A clear ValueError naming the argument, where protobuf would say only "Value out of range"."""
    if value not in limit:
        raise ValueError(f"{name} must be {limit.describe()}, got {value!r}")


def request_from(prompt: str | Sequence[int], max_tokens: int, request_id: str | None) -> pb.GenerateRequest:
    """The request, or ValueError naming the argument the wire cannot carry (the server checks
    the rest: the vocabulary, its cache's capacity)."""
    _check(max_tokens, MAX_TOKENS_WIRE, "max_tokens")
    if request_id is not None and not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {request_id!r}")
    if not isinstance(prompt, str):
        for token in prompt:
            _check(token, limits.TOKEN_ID, "prompt")
    if isinstance(prompt, str):
        return pb.GenerateRequest(request_id=request_id or "", prompt=prompt, max_tokens=max_tokens)
    return pb.GenerateRequest(request_id=request_id or "", prompt_token_ids=list(prompt), max_tokens=max_tokens)


_FINISH = {pb.FINISH_REASON_LENGTH: "length"}


def result_from(chunks: Sequence[TokenChunk], summary: pb.GenerateSummary) -> GenerateResult:
    t = summary.transfer
    return GenerateResult(
        request_id=summary.request_id,
        token_ids=tuple(i for c in chunks for i in c.token_ids),
        text="".join(c.text for c in chunks),
        prompt_token_count=summary.prompt_token_count,
        generated_token_count=summary.generated_token_count,
        num_transferred_tokens=summary.num_transferred_tokens,
        finish_reason=_FINISH.get(summary.finish_reason, "unspecified"),
        prefill_engine_id=summary.prefill_engine_id,
        prefill_target=summary.prefill_target,
        transfer=TransferStats(t.attention_bytes, t.conv_bytes, t.ssm_bytes, t.total_bytes, t.read_count, t.descriptor_count),
        prefill_seconds=seconds(summary.prefill_duration),
        read_seconds=seconds(summary.read_duration),
        time_to_first_token_seconds=seconds(summary.time_to_first_token),
        total_seconds=seconds(summary.total_duration),
        state_verified=summary.state_verified,
    )
