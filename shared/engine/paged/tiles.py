"""Every matmul over tokens goes through `linear`, so batch invariance has one home.

torch's CPU GEMM picks its kernel (and with it the summation order) by the number of rows: a
row's bits at M = 1 differ from the same row's at M = 2 or 64. For one fixed call shape, though,
a row's bits depend neither on its position nor on the other rows. So with `invariant` the rows
are padded to a multiple of `TILE_ROWS` and F.linear runs once per tile of exactly that shape;
without it one F.linear covers every row (the fastest path, and the negative control).

Decode steps also run their row-wise work (norms, activations, SSM updates) on tensors of
exactly `TILE_ROWS` rows (model.py pads a step's requests to it), so those kernels see the same
shapes, and treat every row alike, whatever the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows per GEMM call in invariant mode, and requests per decode forward. A multiple of 16, so a
# tile of any width is whole SIMD vectors and no row falls into a kernel's scalar tail.
TILE_ROWS = 16


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """`x` with zero rows appended up to `rows` rows (itself when it has them)."""
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], dim=0)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, invariant: bool = False) -> Tensor:
    """`x @ weight.T + bias` over the rows of `x` ([rows, in]); with `invariant`, in tiles of
    TILE_ROWS rows so each row's bits are independent of how many rows there are."""
    if not invariant:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if rows == TILE_ROWS:
        return F.linear(x, weight, bias)
    padded = pad_rows(x, -(-rows // TILE_ROWS) * TILE_ROWS)
    out = [F.linear(padded[i : i + TILE_ROWS], weight, bias) for i in range(0, padded.shape[0], TILE_ROWS)]
    return torch.cat(out, dim=0)[:rows]
