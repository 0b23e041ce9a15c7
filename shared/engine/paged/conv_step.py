"""The causal depthwise conv of a decode step: one new token per request, so each channel's
output is one dot product of its K-tap window with its kernel.

Written as an elementwise product and a sum over the window rather than a conv1d call: one
output column does not need a convolution kernel's set-up, and every row's sum runs over its
own K values only, in the same order whatever the other rows. Products and sum run in fp32 with
one rounding at the end, as the conv kernel accumulates a bf16 conv (products rounded to bf16
one by one drift from it by more than the engine's bf16 tolerance against transformers).

The products and sums run on the requests' rows only, not on a batch-invariant step's whole
stack (tiles.py): an IEEE product or sum rounds alike in a kernel's vector and scalar loops, and
a sum's order over K depends on K alone, so neither needs the stack's padding rows. The rounding
to a 16-bit dtype, which could round otherwise in a scalar tail, runs on the whole stack.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shared.engine.paged.tiles import pad_rows


def conv_step(window: Tensor, weight: Tensor, bias: Tensor | None, rows: int) -> Tensor:
    """`window` [n, C, K] (each of n requests' last K inputs per channel, oldest first), `weight`
    [C, K], `bias` [C] or None: the conv output of the newest input, [rows, C] in `window`'s
    dtype, zero after the n requests' rows (rows >= n: the step's stack)."""
    dtype = window.dtype
    out = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    out = pad_rows(out, rows)
    return out if dtype == torch.float32 else out.to(dtype)
