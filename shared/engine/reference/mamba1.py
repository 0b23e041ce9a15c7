"""Mamba1 mixer with Jamba's dt/B/C RMSNorms, recurrent form, one token per call.

Decay is per (channel, state) pair: `S[d] <- exp(Delta_d A[d]) * S[d] + Delta_d x_d B`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.reference.conv import causal_conv_step
from shared.engine.reference.initializers import (
    ParamSpec,
    constant,
    conv_weight,
    dt_bias,
    linear,
    log_uniform_a,
)
from shared.engine.reference.numerics import rms_norm
from shared.layout.spec import Mamba1Dims

# As for Mamba2 (see initializers); Mamba1 has no output norm, so out_proj also gets a gain to
# let the mixer weigh against the residual stream.
A_RANGE = (1.0, 4.0)
D_SKIP = 0.1
OUT_GAIN = 3.0


def mamba1_params(d: Mamba1Dims, hidden: int) -> dict[str, ParamSpec]:
    return {
        "in_proj": ParamSpec((2 * d.d_inner, hidden), linear(hidden)),
        "conv_w": ParamSpec((d.d_inner, d.conv_kernel), conv_weight(d.conv_kernel)),
        "conv_b": ParamSpec((d.d_inner,), conv_weight(d.conv_kernel)),
        "x_proj": ParamSpec((d.dt_rank + 2 * d.d_state, d.d_inner), linear(d.d_inner)),
        "dt_norm": ParamSpec((d.dt_rank,), constant(1.0)),
        "b_norm": ParamSpec((d.d_state,), constant(1.0)),
        "c_norm": ParamSpec((d.d_state,), constant(1.0)),
        "dt_proj_w": ParamSpec((d.d_inner, d.dt_rank), linear(d.dt_rank)),
        "dt_proj_b": ParamSpec((d.d_inner,), dt_bias()),
        "A_log": ParamSpec((d.d_inner, d.d_state), log_uniform_a(*A_RANGE)),
        "D": ParamSpec((d.d_inner,), constant(D_SKIP)),
        "out_proj": ParamSpec((hidden, d.d_inner), linear(d.d_inner, OUT_GAIN)),
    }


class Mamba1:
    def __init__(self, d: Mamba1Dims, w: Mapping[str, Tensor]) -> None:
        self.d = d
        self.in_proj, self.out_proj, self.x_proj = w["in_proj"], w["out_proj"], w["x_proj"]
        self.conv_w, self.conv_b = w["conv_w"], w["conv_b"]
        self.dt_norm, self.b_norm, self.c_norm = w["dt_norm"], w["b_norm"], w["c_norm"]
        self.dt_proj_w, self.dt_proj_b, self.D = w["dt_proj_w"], w["dt_proj_b"], w["D"]
        self.A = -torch.exp(w["A_log"])

    def selective_params(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(Delta `[..., D]`, B `[..., N]`, C `[..., N]`) from the conv output x `[..., D]`."""
        d = self.d
        dbc = F.linear(x, self.x_proj)
        delta = rms_norm(dbc[..., : d.dt_rank], self.dt_norm)
        b = rms_norm(dbc[..., d.dt_rank : d.dt_rank + d.d_state], self.b_norm)
        c = rms_norm(dbc[..., d.dt_rank + d.d_state :], self.c_norm)
        return F.softplus(F.linear(delta, self.dt_proj_w, self.dt_proj_b)), b, c

    def step(self, h: Tensor, conv: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h `[hidden]`, conv `[D, K-1]`, ssm `[D, N]` -> (out, conv, ssm)."""
        xz = torch.mv(self.in_proj, h)
        x, z = xz[: self.d.d_inner], xz[self.d.d_inner :]
        x, conv = causal_conv_step(x, conv, self.conv_w, self.conv_b)
        delta, b, c = self.selective_params(x)
        ssm = torch.exp(delta.unsqueeze(-1) * self.A) * ssm + (delta * x).unsqueeze(-1) * b
        y = torch.mv(ssm, c) + self.D * x
        return F.linear(y * F.silu(z), self.out_proj), conv, ssm
