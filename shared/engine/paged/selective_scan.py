"""Mamba1's selective scan over one prefill chunk in segments, instead of token by token.

The recurrence `h_t = decay_t * h_(t-1) + input_t` has a decay per channel and per state, so it
has no matmul form; but it is linear in its starting state. So the chunk's tokens are cut into
segments of `SEGMENT` tokens, every segment is scanned from zero at once (one step per position
in a segment, each step over all segments), the segments' starting states follow one after the
other (one step per segment), and each token then adds its segment's starting state times the
decay since the segment began. Every decay product stays in (0, 1]: nothing is divided out.

A token's bits depend on the chunk's length and its place in it, never on other chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Tokens per segment. The steps a chunk of T tokens takes: SEGMENT - 1 + ceil(T / SEGMENT).
SEGMENT = 32


def _segments(x: Tensor, count: int, length: int) -> Tensor:
    """[T, ...] -> [length, count, ...]: position in segment first, zero rows after token T."""
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, count * length - x.shape[0]))
    return padded.view(count, length, *x.shape[1:]).transpose(0, 1).contiguous()


def _tokens(x: Tensor, t: int) -> Tensor:
    """[length, count, ...] -> [T, ...]: the inverse of `_segments`."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])[:t]


def selective_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """x [T, D] (the conv output), dt [T, D] (fp32, after softplus), A [D, N] (fp32), B and C
    [T, N], state [D, N] (fp32) before the first token. Returns y [T, D] in `out_dtype` (each
    token's state cast to it, times C_t; no D skip) and the fp32 state after the last token."""
    t = x.shape[0]
    length = min(SEGMENT, t)
    count = -(-t // length)
    dt_s, x_s = _segments(dt, count, length), _segments(x.float(), count, length)  # [L, S, D]
    b_s, c_s = _segments(B.float(), count, length), _segments(C, count, length)  # [L, S, N]
    # Padding rows have dt = 0: decay 1 and input 0, so they leave a state as it was.
    decay = torch.mul(dt_s[..., None], A).exp_()  # [L, S, D, N]
    inputs = (dt_s * x_s)[..., None] * b_s[:, :, None, :]
    local = inputs  # each segment's states, scanned from zero in place of its inputs
    # The decay from each segment's start to each position, in place of the decays: step i
    # reads decay[i] before it turns it into since[i].
    since = decay
    for i in range(1, length):
        local[i].addcmul_(decay[i], local[i - 1])
        since[i].mul_(since[i - 1])
    starts = torch.empty_like(local[0])  # [S, D, N]: the state entering each segment
    h = state.to(torch.float32)
    for s in range(count):
        starts[s] = h
        h = torch.addcmul(local[-1, s], since[-1, s], h)
    local.addcmul_(since, starts[None])  # every token's state
    y = torch.matmul(local.to(out_dtype), c_s[..., None])[..., 0]  # [L, S, D]
    return _tokens(y, t), h


def selective_scan_sequential(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, state: Tensor, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The same scan token by token (transformers' order): the oracle the tests hold the
    segmented scan to, and the baseline of its benchmark."""
    decay = torch.exp(A[None] * dt[:, :, None])
    inputs = dt[:, :, None] * B.float()[:, None, :] * x.float()[:, :, None]
    h = state.to(torch.float32)
    ys = []
    for i in range(x.shape[0]):
        h = decay[i] * h + inputs[i]
        ys.append(torch.matmul(h.to(out_dtype), C[i][:, None])[:, 0])
    return torch.stack(ys), h
