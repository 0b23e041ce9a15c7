"""Log probabilities of drawn tokens, as vLLM returns them by default ("raw" logprobs).

A token's log probability is read from the model's own distribution: log_softmax of the
logits the token was drawn from, in fp32 on the CPU, before min_tokens masking, temperature,
top-k or top-p. So the numbers do not depend on the sampling parameters, and a masked or
filtered token still has its model probability. The same logits give the same bits, so prefill
(the first token at the full-N boundary) and decode give what a colocated run gives.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from shared.token_logprobs import TokenLogprobs

__all__ = ["TokenLogprobs", "token_logprobs"]


def token_logprobs(logits: Tensor, token_id: int, k: int) -> TokenLogprobs:
    """`token_id`'s log probability under `logits` [vocab] and the `k` likeliest tokens."""
    scores = logits.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    logp = torch.log_softmax(scores, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        # A stable sort on the negated values: equal log probabilities keep id order.
        order = torch.argsort(-logp, stable=True)[:k]
        top = tuple((int(i), float(logp[i])) for i in order)
    return TokenLogprobs(int(token_id), float(logp[token_id]), top)


def point_mass(token_id: int, k: int) -> TokenLogprobs:
    """An engine without logits (the synthetic one) draws its token with probability 1."""
    return TokenLogprobs(int(token_id), 0.0, ((int(token_id), 0.0),) if k > 0 else ())


@runtime_checkable
class WithLogits(Protocol):
    """A decode session that keeps the logits its last step drew from."""

    last_logits: Tensor | None


def session_logprobs(session: object, token_id: int, k: int) -> TokenLogprobs:
    """The logprobs of the token `session`'s last step drew; a session without logits (an engine
    that does not sample) drew it with probability 1."""
    if isinstance(session, WithLogits):
        if session.last_logits is None:
            raise ValueError("logprobs: the session has not stepped")
        return token_logprobs(session.last_logits, token_id, k)
    return point_mass(token_id, k)
