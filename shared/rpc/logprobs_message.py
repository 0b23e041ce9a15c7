"""`TokenLogprobs` (shared/engine/logprobs.py) to and from its protobuf message."""

from __future__ import annotations

from shared.engine.logprobs import TokenLogprobs
from shared.errors import Internal
from shared.pb.hybridpd.v1 import logprobs_pb2 as pb


def logprobs_message(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    )


def logprobs_of(msg: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def checked_first(lp: TokenLogprobs | None, token_id: int, k: int | None, field: str) -> list[TokenLogprobs] | None:
    """The first token's logprobs as prefill sent them, for a chunk: None when the request asked
    for none (k None); else they must be `token_id`'s with `k` likeliest tokens (a prefill that
    sent none, or others, is at fault: INTERNAL naming `field`)."""
    if k is None:
        return None
    if lp is None or lp.token_id != token_id or len(lp.top) != k:
        got = "none" if lp is None else f"those of token {lp.token_id} with {len(lp.top)} likeliest tokens"
        raise Internal(f"prefill sent {got} for first token {token_id}; the request asked for {k} likeliest", field=field)
    return [lp]
