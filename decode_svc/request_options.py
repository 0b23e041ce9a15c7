"""What a GenerateRequest asks of decoding besides its prompt: sampling and when to stop
(min_tokens: both the sampler's mask and the stop rule).

Bad values name their field (`sampling.temperature`, ...). An unseeded sampled request gets a
random seed here, reported back in the summary, so every request is reproducible afterwards.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from shared.engine.protocol import Engine
from shared.engine.sampling import GREEDY, SamplingError, SamplingParams, leaves_a_token, with_min_tokens
from shared.engine.stopping import StopRule
from shared.errors import FieldIssue, InvalidArgument
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb


@dataclass(frozen=True)
class DecodeOptions:
    sampling: SamplingParams
    stop: StopRule


def sampling_from(s: pb.SamplingParams) -> SamplingParams:
    """The engine's parameters for a request's `sampling` (an unset seed: a random one)."""
    seed = s.seed if s.HasField("seed") else (secrets.randbits(64) if s.temperature > 0 else 0)
    try:
        return SamplingParams(temperature=s.temperature, top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=s.top_k, seed=seed)
    except SamplingError as e:
        raise InvalidArgument(e.detail, field=f"sampling.{e.field}") from None


def sampling_of(request: pb.GenerateRequest, engine: Engine) -> SamplingParams:
    if not request.HasField("sampling"):
        return GREEDY
    params = sampling_from(request.sampling)
    if not params.greedy and not engine.samples:
        raise InvalidArgument(
            f"sampling.temperature {params.temperature}: this engine ({engine.spec.name}) decodes greedily only; "
            "send temperature 0 or leave sampling unset",
            field="sampling.temperature",
        )
    return params


def decode_options(request: pb.GenerateRequest, engine: Engine) -> DecodeOptions:
    vocab = engine.spec.vocab_size
    bad = [t for t in request.stop_token_ids if t >= vocab]
    if bad:
        raise InvalidArgument(f"token ids must be < {vocab} (the vocabulary), got {bad[:4]}", field="stop_token_ids")
    if request.min_tokens > request.max_tokens:
        raise InvalidArgument(f"{request.min_tokens} is more than max_tokens ({request.max_tokens})", field="min_tokens")
    stop = StopRule.of(
        request.max_tokens,
        engine.eos_token_ids,
        request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
    )
    # The sampler masks exactly the ids the rule stops at (those it can draw), until min_tokens.
    masked = frozenset(t for t in stop.stop_token_ids if t < vocab)
    sampling = with_min_tokens(sampling_of(request, engine), request.min_tokens, masked)
    if not leaves_a_token(sampling, vocab):
        raise InvalidArgument(
            f"with the EOS ids (unless ignore_eos) they cover the whole vocabulary ({vocab} ids): no token is "
            f"left to draw before min_tokens ({request.min_tokens}); send fewer stop ids or a smaller min_tokens",
            field="stop_token_ids",
            issues=[FieldIssue("min_tokens", f"{request.min_tokens}, but the stop ids leave no token to draw")],
        )
    return DecodeOptions(sampling, stop)


def finish_reason_message(reason: str | None) -> pb.FinishReason.ValueType:
    return pb.FINISH_REASON_STOP if reason == "stop" else pb.FINISH_REASON_LENGTH
