"""What the wire and the engine can hold: one range per request field, used by every surface.

The integer ranges are read from the field types of protos/hybridpd/v1 (a `uint32` field holds
[0, 2**32 - 1], a `uint64` one [0, 2**64 - 1]), narrowed where the engine needs more (max_tokens
>= 1, top_p in (0, 1]). The HTTP front door, the gRPC Generate handler and `hybrid-pd generate`
check their values against these before building a message, so a value that does not fit is
refused naming its field (HTTP 400, INVALID_ARGUMENT, exit 2) instead of failing inside the
protobuf library ("Value out of range") or being wrapped into another value.

Floats: the wire's fields are doubles, but the engine samples in fp32, so a float field holds a
finite number within float32's range (NaN and infinities are refused everywhere).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from shared.errors import InvalidArgument
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb

FLOAT32_MAX = 3.4028234663852886e38

_F = FieldDescriptor
_WIDTHS: dict[int, tuple[int, int]] = {
    **dict.fromkeys((_F.TYPE_UINT32, _F.TYPE_FIXED32), (0, 2**32 - 1)),
    **dict.fromkeys((_F.TYPE_INT32, _F.TYPE_SINT32, _F.TYPE_SFIXED32), (-(2**31), 2**31 - 1)),
    **dict.fromkeys((_F.TYPE_UINT64, _F.TYPE_FIXED64), (0, 2**64 - 1)),
    **dict.fromkeys((_F.TYPE_INT64, _F.TYPE_SINT64, _F.TYPE_SFIXED64), (-(2**63), 2**63 - 1)),
}


@dataclass(frozen=True)
class IntRange:
    """Integers in [low, high], both inclusive."""

    low: int
    high: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high

    def describe(self) -> str:
        return f"an integer >= {self.low} and <= {self.high}"

    def check(self, value: int, field: str) -> int:
        """`value`, or InvalidArgument naming `field` when it is outside the range."""
        if value not in self:
            raise InvalidArgument(f"must be {self.describe()}, got {value}", field=field)
        return value


@dataclass(frozen=True)
class FloatRange:
    """Finite numbers in [low, high] (`(low, high]` when `open_low`)."""

    low: float
    high: float
    open_low: bool = False

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any double
            return False
        low_ok = number > self.low if self.open_low else number >= self.low
        return math.isfinite(number) and low_ok and number <= self.high

    def describe(self) -> str:
        return f"a finite number {'>' if self.open_low else '>='} {self.low:g} and <= {self.high:g}"

    def check(self, value: float, field: str) -> float:
        if value not in self:
            raise InvalidArgument(f"must be {self.describe()}, got {value}", field=field)
        return float(value)


def wire_range(message: Descriptor, name: str) -> IntRange:
    """The integers field `name` of `message` holds on the wire (from its protobuf type)."""
    low, high = _WIDTHS[message.fields_by_name[name].type]
    return IntRange(low, high)


_REQUEST = pb.GenerateRequest.DESCRIPTOR
_SAMPLING = pb.SamplingParams.DESCRIPTOR

# GenerateRequest
TOKEN_ID = wire_range(_REQUEST, "prompt_token_ids")  # also stop_token_ids (the same type; checked below)
MAX_TOKENS = replace(wire_range(_REQUEST, "max_tokens"), low=1)
MIN_TOKENS = wire_range(_REQUEST, "min_tokens")
# SamplingParams
TOP_K = wire_range(_SAMPLING, "top_k")  # 0: off
SEED = wire_range(_SAMPLING, "seed")  # the sampler's seeds too: [0, 2**64)
TEMPERATURE = FloatRange(0.0, FLOAT32_MAX)  # 0: greedy
TOP_P = FloatRange(0.0, 1.0, open_low=True)
SEQUENCES = IntRange(0, 16)  # n: sequences per request (0: 1)
LOGPROBS = IntRange(0, 20)  # top logprobs per token: vLLM's default max_logprobs, OpenAI's top_logprobs bound

# HTTP spellings of the same fields: what the OpenAI / vLLM bodies allow, inside the wire's ranges.
HTTP_TOP_K = replace(TOP_K, low=-1)  # vLLM's -1: off
HTTP_TEMPERATURE = replace(TEMPERATURE, high=2.0)  # OpenAI's range
# OpenAI and vLLM take signed 64-bit seeds: a negative one is sent as the same 64 bits unsigned.
HTTP_SEED = IntRange(-(2**63), SEED.high)
PENALTY = FloatRange(-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's range)

assert wire_range(_REQUEST, "stop_token_ids") == TOKEN_ID


def seed_bits(seed: int) -> int:
    """An HTTP seed (HTTP_SEED) as the wire's and the sampler's (SEED): its 64 bits, unsigned."""
    return seed + 2**64 if seed < 0 else seed


def check_token_ids(ids: object, field: str) -> list[int]:
    """A list of token ids the wire holds (each in TOKEN_ID), or InvalidArgument naming `field`."""
    if not isinstance(ids, list):
        raise InvalidArgument(f"must be a list of token ids, got {ids!r}", field=field)
    for t in ids:
        if t not in TOKEN_ID:
            raise InvalidArgument(f"token ids must be {TOKEN_ID.describe()}, got {t!r}", field=field)
    return [int(t) for t in ids]


def check_sampling(s: pb.SamplingParams, prefix: str = "sampling.") -> None:
    """A GenerateRequest's sampling within range (integers always are, off the wire; floats may
    be NaN, infinite or beyond float32)."""
    TEMPERATURE.check(s.temperature, prefix + "temperature")
    if s.HasField("top_p"):
        TOP_P.check(s.top_p, prefix + "top_p")
    TOP_K.check(s.top_k, prefix + "top_k")
    if s.HasField("seed"):
        SEED.check(s.seed, prefix + "seed")


def check_request(request: pb.GenerateRequest) -> None:
    """Every number of a GenerateRequest within its range, each problem naming its field."""
    MAX_TOKENS.check(request.max_tokens, "max_tokens")
    MIN_TOKENS.check(request.min_tokens, "min_tokens")
    SEQUENCES.check(request.n, "n")
    if request.HasField("logprobs"):
        LOGPROBS.check(request.logprobs, "logprobs")
    if request.HasField("prompt_logprobs"):
        LOGPROBS.check(request.prompt_logprobs, "prompt_logprobs")
    if request.HasField("sampling"):
        check_sampling(request.sampling)
