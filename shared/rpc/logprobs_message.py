"""`TokenLogprobs` (shared/engine/logprobs.py) to and from its protobuf message."""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.logprobs import TokenLogprobs
from shared.errors import Internal
from shared.pb.hybridpd.v1 import logprobs_pb2 as pb


def logprobs_message(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    )


def logprobs_of(msg: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def checked_prompt(lps: Sequence[TokenLogprobs] | None, prompt: Sequence[int], k: int, field: str) -> list[TokenLogprobs]:
    """The prompt logprobs prefill computed: one per prompt token but the first, each of that
    token with `k` likeliest (else INTERNAL naming `field`: the prefill is at fault)."""
    got = list(lps or ())
    ok = len(got) == len(prompt) - 1 and all(
        lp.token_id == t and len(lp.top) == k for lp, t in zip(got, prompt[1:], strict=False)
    )
    if not ok:
        raise Internal(
            f"prefill sent {len(got)} prompt logprobs for a prompt of {len(prompt)} tokens with {k} likeliest each, "
            "or for other tokens",
            field=field,
        )
    return got


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
