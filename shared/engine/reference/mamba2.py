"""Mamba2 mixer (Nemotron-H / Bamba / Granite style), recurrent form, one token per call.

in_proj output order is `[z (I) | xBC (I+2GN) | dt (H)]`; head h uses group h // (H/G).
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
from shared.layout.spec import Mamba2Dims

# A in [1, 4] and a small skip D keep the recurrent state the dominant part of y (see initializers).
A_RANGE = (1.0, 4.0)
D_SKIP = 0.1


def mamba2_params(d: Mamba2Dims, hidden: int) -> dict[str, ParamSpec]:
    i, conv_dim = d.intermediate, d.intermediate + 2 * d.n_groups * d.d_state
    return {
        "in_proj": ParamSpec((i + conv_dim + d.num_heads, hidden), linear(hidden)),
        "conv_w": ParamSpec((conv_dim, d.conv_kernel), conv_weight(d.conv_kernel)),
        "conv_b": ParamSpec((conv_dim,), conv_weight(d.conv_kernel)),
        "dt_bias": ParamSpec((d.num_heads,), dt_bias()),
        "A_log": ParamSpec((d.num_heads,), log_uniform_a(*A_RANGE)),
        "D": ParamSpec((d.num_heads,), constant(D_SKIP)),
        "norm_w": ParamSpec((i,), constant(1.0)),
        "out_proj": ParamSpec((hidden, i), linear(i)),
    }


class Mamba2:
    def __init__(self, d: Mamba2Dims, w: Mapping[str, Tensor]) -> None:
        self.d = d
        self.in_proj, self.out_proj = w["in_proj"], w["out_proj"]
        self.conv_w, self.conv_b = w["conv_w"], w["conv_b"]
        self.dt_bias, self.D, self.norm_w = w["dt_bias"], w["D"], w["norm_w"]
        self.A = -torch.exp(w["A_log"])
        self.i = d.intermediate
        self.gn = d.n_groups * d.d_state
        self.heads_per_group = d.num_heads // d.n_groups

    def split_in_proj(self, zxbcdt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(z, xBC, dt) along the last axis."""
        i, gn = self.i, self.gn
        return zxbcdt[..., :i], zxbcdt[..., i : 2 * i + 2 * gn], zxbcdt[..., 2 * i + 2 * gn :]

    def gated_norm_out(self, y: Tensor, z: Tensor) -> Tensor:
        """Grouped gated RMSNorm (norm after gate, one RMS per group of I/G channels), out_proj."""
        d = self.d
        u = (y * F.silu(z)).reshape(*y.shape[:-1], d.n_groups, self.i // d.n_groups)
        u = rms_norm(u, self.norm_w.view(d.n_groups, -1)).reshape(*y.shape)
        return F.linear(u, self.out_proj)

    def step(self, h: Tensor, conv: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h `[hidden]`, conv `[I+2GN, K-1]`, ssm `[H, P, N]` -> (out `[hidden]`, conv, ssm)."""
        d = self.d
        g, hpg, p, n = d.n_groups, self.heads_per_group, d.head_dim, d.d_state
        z, xbc, dt = self.split_in_proj(torch.mv(self.in_proj, h))
        xbc, conv = causal_conv_step(xbc, conv, self.conv_w, self.conv_b)
        x = xbc[: self.i].view(g, hpg, p, 1)
        b = xbc[self.i : self.i + self.gn].view(g, 1, 1, n)
        c = xbc[self.i + self.gn :].view(g, 1, n, 1)
        dt = F.softplus(dt + self.dt_bias)  # [H]
        decay = torch.exp(dt * self.A).view(g, hpg, 1, 1)
        ssm = decay * ssm.view(g, hpg, p, n) + (dt.view(g, hpg, 1, 1) * x) * b
        y = torch.matmul(ssm, c).view(d.num_heads, p) + self.D.view(-1, 1) * x.view(d.num_heads, p)
        ssm = ssm.view(d.num_heads, p, n)
        return self.gated_norm_out(y.reshape(-1), z), conv, ssm
