"""The causal depthwise short convolution, one token at a time, with its K-1 window of state."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_conv_step(xin: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """One token of `silu(bias + sum_j w[:, j] * x_{t-K+1+j})`.

    xin: `[C]` raw conv input of this token; window: `[C, K-1]` raw inputs of the previous
    K-1 tokens (index 0 oldest); weight: `[C, K]`. Returns (activated output `[C]`, new window).
    Written as an explicit K-tap sum rather than `conv1d`, whose kernel choice depends on shape.
    """
    full = torch.cat((window, xin.unsqueeze(1)), dim=1)  # [C, K]
    out = (full * weight).sum(dim=1)
    if bias is not None:
        out = out + bias
    return torch.nn.functional.silu(out), full[:, 1:]
