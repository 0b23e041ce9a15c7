"""Mamba2's chunked SSD scan gives the recurrence token by token at any block size: at the
engine's `SCAN_BLOCK` and at a checkpoint's larger chunk_size alike, across block boundaries,
from a non-zero state, with B and C per head or per group (negative controls: from another
state, or with the heads given other groups, it differs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.mamba2 import SCAN_BLOCK, ssd_scan

HEADS, P, N = 4, 8, 16
TOLERANCE = 1e-5  # relative to the largest value


def _inputs(t: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, HEADS, P, generator=g)
    dt = F.softplus(torch.randn(t, HEADS, generator=g) - 1)
    a = -torch.linspace(0.05, 2.0, HEADS)
    b, c = (torch.randn(t, HEADS, N, generator=g) for _ in range(2))
    return x, dt, a, b, c, torch.randn(HEADS, generator=g), torch.randn(HEADS, P, N, generator=g)


def _recurrence(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    ys = []
    for i in range(x.shape[0]):
        decay = torch.exp(dt[i] * a)[:, None, None]
        state = decay * state + (dt[i][:, None] * x[i])[:, :, None] * b[i][:, None, :]
        ys.append((state * c[i][:, None, :]).sum(-1) + x[i] * d[:, None])
    return torch.stack(ys), state


def _relative(got: Tensor, want: Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("block", [SCAN_BLOCK, 128])
@pytest.mark.parametrize("t", [1, SCAN_BLOCK - 1, SCAN_BLOCK, SCAN_BLOCK + 1, 4 * SCAN_BLOCK + 5])
def test_any_block_size_gives_the_recurrence(t: int, block: int) -> None:
    x, dt, a, b, c, d, state = _inputs(t)
    y, final = ssd_scan(x, dt, a, b, c, d, state, block)
    want_y, want_final = _recurrence(x, dt, a, b, c, d, state)
    assert y.shape == want_y.shape == (t, HEADS, P)
    assert _relative(y, want_y) <= TOLERANCE
    assert _relative(final, want_final) <= TOLERANCE


def test_heads_read_their_groups_b_and_c() -> None:
    """B and C given per group (2 groups of 2 heads): head h reads group h // 2, as if each head
    had its group's copy (negative control: the other order of heads differs)."""
    x, dt, a, b, c, d, state = _inputs(2 * SCAN_BLOCK + 3)
    groups = 2
    bg, cg = b[:, :groups], c[:, :groups]
    y, final = ssd_scan(x, dt, a, bg, cg, d, state, SCAN_BLOCK)
    rep = HEADS // groups
    want_y, want_final = _recurrence(x, dt, a, bg.repeat_interleave(rep, 1), cg.repeat_interleave(rep, 1), d, state)
    assert _relative(y, want_y) <= TOLERANCE and _relative(final, want_final) <= TOLERANCE
    other_y, _ = _recurrence(x, dt, a, bg.repeat(1, rep, 1), cg.repeat(1, rep, 1), d, state)
    assert _relative(y, other_y) > TOLERANCE


def test_negative_control_the_starting_state_shows() -> None:
    x, dt, a, b, c, d, state = _inputs(SCAN_BLOCK + 3)
    y, final = ssd_scan(x, dt, a, b, c, d, state, SCAN_BLOCK)
    other_y, other_final = _recurrence(x, dt, a, b, c, d, state * 1.01)
    assert _relative(y, other_y) > TOLERANCE and _relative(final, other_final) > TOLERANCE
