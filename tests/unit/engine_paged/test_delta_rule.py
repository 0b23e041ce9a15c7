"""The gated delta rule of a GDN prefill in blocks against the same rule token by token: the
outputs and the state after the chunk within rounding, on both sides of block boundaries,
from a non-zero state (negative control: from another state they differ)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.delta_rule import BLOCK, chunked_delta_rule, delta_rule_sequential

HEADS, DK, DV = 4, 8, 12
TOLERANCE = 1e-5  # relative to the largest value


def _inputs(t: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(t)
    q = F.normalize(torch.randn(t, HEADS, DK, generator=g), dim=-1) / DK**0.5
    k = F.normalize(torch.randn(t, HEADS, DK, generator=g), dim=-1)
    v = torch.randn(t, HEADS, DV, generator=g)
    log_decay = -F.softplus(torch.randn(t, HEADS, generator=g)) * 0.3
    beta = torch.sigmoid(torch.randn(t, HEADS, generator=g))
    return q, k, v, log_decay, beta, torch.randn(HEADS, DV, DK, generator=g)


def _relative(got: Tensor, want: Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("t", [1, 6, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 9])
def test_blocks_give_the_token_by_token_rule(t: int) -> None:
    q, k, v, g, beta, state = _inputs(t)
    out, final = chunked_delta_rule(q, k, v, g, beta, state)
    want_out, want_final = delta_rule_sequential(q, k, v, g, beta, state)
    assert out.shape == want_out.shape == (t, HEADS, DV) and final.shape == (HEADS, DV, DK)
    assert _relative(out, want_out) <= TOLERANCE
    assert _relative(final, want_final) <= TOLERANCE


@pytest.mark.parametrize("t", [5, BLOCK + 9])
def test_negative_control_the_starting_state_shows(t: int) -> None:
    """The comparison can fail: from a slightly other state the outputs differ (and, while
    the decay has not yet forgotten it, the state after the chunk)."""
    q, k, v, g, beta, state = _inputs(t)
    out, final = chunked_delta_rule(q, k, v, g, beta, state)
    other_out, other_final = delta_rule_sequential(q, k, v, g, beta, state * 1.01)
    assert _relative(out, other_out) > TOLERANCE
    assert t > BLOCK or _relative(final, other_final) > TOLERANCE
