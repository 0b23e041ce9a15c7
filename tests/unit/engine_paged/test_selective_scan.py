"""Mamba1's prefill scan in segments against the same recurrence token by token (transformers'
order): the outputs and the state after the chunk within rounding, on both sides of segment
boundaries, from a non-zero state (negative control: from another state they differ)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.selective_scan import SEGMENT, selective_scan, selective_scan_sequential

D, N = 24, 8


def _inputs(t: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, D, generator=g).to(dtype)
    dt = F.softplus(torch.randn(t, D, generator=g) - 1)
    a = -torch.arange(1, N + 1, dtype=torch.float32).repeat(D, 1) * 0.3
    b, c = (torch.randn(t, N, generator=g).to(dtype) for _ in range(2))
    return x, dt, a, b, c, torch.randn(D, N, generator=g)


def _relative(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t", [1, 5, SEGMENT - 1, SEGMENT, SEGMENT + 1, 3 * SEGMENT + 7])
def test_segments_give_the_token_by_token_scan(t: int, dtype: torch.dtype, tol: float) -> None:
    x, dt, a, b, c, state = _inputs(t, dtype)
    y, final = selective_scan(x, dt, a, b, c, state, dtype)
    want_y, want_final = selective_scan_sequential(x, dt, a, b, c, state, dtype)
    assert y.shape == want_y.shape == (t, D) and y.dtype == dtype and final.dtype == torch.float32
    assert _relative(y, want_y) <= tol
    assert _relative(final, want_final) <= 1e-5  # the state stays fp32 whatever the dtype


@pytest.mark.parametrize("t", [5, 2 * SEGMENT + 3])
def test_negative_control_the_starting_state_shows(t: int) -> None:
    """The comparison can fail: from a slightly other state the outputs differ (and, while
    the decay has not yet forgotten it, the state after the chunk)."""
    x, dt, a, b, c, state = _inputs(t, torch.float32)
    y, final = selective_scan(x, dt, a, b, c, state, torch.float32)
    other_y, other_final = selective_scan_sequential(x, dt, a, b, c, state * 1.01, torch.float32)
    assert _relative(y, other_y) > 1e-5
    assert t > SEGMENT or _relative(final, other_final) > 1e-5
