"""The Mamba1 mixer (Jamba) on explicit states: conv `[D, K-1]`, SSM `[D, N]` in fp32.

Prefill runs the recurrence over a chunk in segments from any state (selective_scan.py: the
decay is per channel and per state, so no chunked matmul form applies); a decode step runs it
for a tile of requests at once. Jamba's RMS norms on dt, B and C follow x_proj. The dtype
flow follows transformers' torch paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.conv_step import conv_step
from shared.engine.paged.norms import rms_norm
from shared.engine.paged.selective_scan import selective_scan
from shared.engine.paged.tiles import linear


@dataclass
class Mamba1:
    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("in_proj", "x_proj", "dt_proj", "out_proj")

    in_proj: Tensor  # [2D, hidden]: [x | z]
    conv_weight: Tensor  # [D, K]
    conv_bias: Tensor | None
    x_proj: Tensor  # [R + 2N, D]
    dt_proj: Tensor  # [D, R]
    dt_bias: Tensor  # [D]
    A: Tensor  # -exp(A_log), fp32, [D, N]
    D: Tensor  # [D]
    out_proj: Tensor
    dt_rank: int
    d_state: int
    dt_norm: Tensor
    b_norm: Tensor
    c_norm: Tensor
    norm_eps: float
    in_bias: Tensor | None = None
    out_bias: Tensor | None = None

    @property
    def conv_dim(self) -> int:
        return int(self.conv_weight.shape[0])

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.conv_dim, self.d_state)

    def _selective(self, x: Tensor, invariant: bool) -> tuple[Tensor, Tensor, Tensor]:
        """dt [rows, D] (fp32, before softplus), B and C [rows, N] from the conv output `x`."""
        dt, b, c = torch.split(linear(x, self.x_proj, invariant=invariant), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = rms_norm(dt, self.dt_norm, self.norm_eps)
        b = rms_norm(b, self.b_norm, self.norm_eps)
        c = rms_norm(c, self.c_norm, self.norm_eps)
        dt = linear(dt, self.dt_proj, invariant=invariant) + self.dt_bias.float()
        return dt, b, c

    def prefill(self, h: Tensor, conv: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`h` [T, hidden] after `conv` [D, K-1] and `ssm` [D, N]: output [T, hidden], new states."""
        dtype = h.dtype
        x, z = linear(h, self.in_proj, self.in_bias).chunk(2, dim=-1)
        window = torch.cat([conv.to(dtype), x.transpose(0, 1)], dim=1)  # [D, K-1+T]
        new_conv = window[:, -(self.conv_weight.shape[1] - 1) :].contiguous()
        x = F.silu(F.conv1d(window[None], self.conv_weight[:, None, :], self.conv_bias, groups=self.conv_dim)[0]).transpose(0, 1)
        dt, b, c = self._selective(x, False)
        y, state = selective_scan(x, F.softplus(dt), self.A, b, c, ssm, dtype)
        y = y + x * self.D
        y = y * F.silu(z)
        return linear(y.to(dtype), self.out_proj, self.out_bias), new_conv, state

    def step(
        self, h: Tensor, conv: Tensor, ssm: Tensor, fresh: Tensor | None, *, invariant: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`h` [R, hidden] (the first n = len(ssm) rows real, then padding), `conv` [n, D, K-1],
        `ssm` [n, D, N] (the caller's own copy, updated in place). The recurrence has no dt
        clamp, so `fresh` changes nothing here."""
        del fresh
        r, n, dtype = h.shape[0], ssm.shape[0], h.dtype
        x, z = linear(h, self.in_proj, self.in_bias, invariant=invariant).chunk(2, dim=-1)
        window = torch.cat([conv.to(dtype), x[:n, :, None]], dim=2)  # [n, D, K]
        x = F.silu(conv_step(window, self.conv_weight, self.conv_bias, r))
        dt, b, c = self._selective(x, invariant)
        dt = F.softplus(dt)  # [R, D] fp32
        decay = torch.exp(dt[:, :, None] * self.A[None])[:n]  # exp on the tile's shape
        inputs = (dt[:n, :, None] * b[:n].float()[:, None, :]) * x[:n].float()[:, :, None]
        new_ssm = ssm.mul_(decay).add_(inputs)  # `ssm` is this step's own copy of the blocks' state
        y = x.new_zeros((r, self.conv_dim))
        y[:n] = (new_ssm.to(dtype) * c[:n, None, :]).sum(-1) + x[:n] * self.D
        y = y * F.silu(z)
        return linear(y.to(dtype), self.out_proj, self.out_bias, invariant=invariant), window[:, :, 1:], new_ssm
