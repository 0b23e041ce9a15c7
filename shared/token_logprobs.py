"""One drawn token's log probability and the likeliest tokens at its position: a plain value,
carried from the engines (shared/engine/logprobs.py computes it) through manifests to the APIs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log probability and the `k` likeliest tokens at its position."""

    token_id: int
    logprob: float  # an fp32 value
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), likeliest first, ties: lower id first
