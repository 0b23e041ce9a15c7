"""Gated DeltaNet mixer (Qwen3.5 style, separate projections), recurrent form, one token per call.

State per value head is `S [Dv, Dk]` (vLLM orientation, the transpose of HF/FLA's `[Dk, Dv]`):
`S <- alpha*S; S <- S + beta * (v - S k) k^T; o = S q`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.reference.conv import causal_conv_step
from shared.engine.reference.initializers import ParamSpec, constant, conv_weight, linear, log_uniform_a
from shared.engine.reference.numerics import l2_norm, rms_norm
from shared.layout.spec import GDNDims

# A = exp(A_log) in [0.01, 1] (Qwen uses [0, 16]): with dt_bias = 1 most heads then keep memory
# across tokens, so the transferred state matters (see initializers).
A_RANGE = (1e-2, 1.0)


def gdn_params(d: GDNDims, hidden: int) -> dict[str, ParamSpec]:
    key, value = d.num_k_heads * d.head_k_dim, d.num_v_heads * d.head_v_dim
    return {
        # Fused [q|k|v (conv input) | z | b | a]: one matmul per token.
        "in_proj": ParamSpec((2 * key + 2 * value + 2 * d.num_v_heads, hidden), linear(hidden)),
        "conv_w": ParamSpec((2 * key + value, d.conv_kernel), conv_weight(d.conv_kernel)),
        "dt_bias": ParamSpec((d.num_v_heads,), constant(1.0)),
        "A_log": ParamSpec((d.num_v_heads,), log_uniform_a(*A_RANGE)),
        "norm_w": ParamSpec((d.head_v_dim,), constant(1.0)),
        "out_proj": ParamSpec((hidden, value), linear(value)),
    }


class GatedDeltaNet:
    def __init__(self, d: GDNDims, w: Mapping[str, Tensor]) -> None:
        self.d = d
        self.in_proj, self.out_proj, self.conv_w = w["in_proj"], w["out_proj"], w["conv_w"]
        self.dt_bias, self.norm_w = w["dt_bias"], w["norm_w"]
        self.A = -torch.exp(w["A_log"])
        self.key = d.num_k_heads * d.head_k_dim
        self.value = d.num_v_heads * d.head_v_dim
        self.conv_dim = 2 * self.key + self.value
        self.v_per_k = d.num_v_heads // d.num_k_heads
        self.q_scale = 1.0 / math.sqrt(d.head_k_dim)

    def split_in_proj(self, proj: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(qkv, z, b, a) along the last axis."""
        c, v, hv = self.conv_dim, self.value, self.d.num_v_heads
        return proj[..., :c], proj[..., c : c + v], proj[..., c + v : c + v + hv], proj[..., c + v + hv :]

    def gates(self, b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """(beta, g): write strength sigmoid(b) and log-decay g = -exp(A_log)*softplus(a+dt_bias)."""
        return torch.sigmoid(b), self.A * F.softplus(a + self.dt_bias)

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Normalised q (scaled) and k repeated to value heads `[..., Hv, Dk]`, v `[..., Hv, Dv]`."""
        d, lead = self.d, qkv.shape[:-1]
        q = qkv[..., : self.key].reshape(*lead, d.num_k_heads, d.head_k_dim)
        k = qkv[..., self.key : 2 * self.key].reshape(*lead, d.num_k_heads, d.head_k_dim)
        v = qkv[..., 2 * self.key :].reshape(*lead, d.num_v_heads, d.head_v_dim)
        q = (l2_norm(q) * self.q_scale).repeat_interleave(self.v_per_k, dim=-2)
        k = l2_norm(k).repeat_interleave(self.v_per_k, dim=-2)
        return q, k, v

    def norm_gate_out(self, o: Tensor, z: Tensor) -> Tensor:
        """Per-head RMSNorm over Dv, then the silu(z) gate, then out_proj. o `[..., Hv, Dv]`."""
        u = rms_norm(o, self.norm_w) * F.silu(z.reshape(o.shape))
        return F.linear(u.reshape(*o.shape[:-2], self.value), self.out_proj)

    def step(self, h: Tensor, conv: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h `[hidden]`, conv `[2HkDk+HvDv, K-1]`, ssm `[Hv, Dv, Dk]` -> (out, conv, ssm)."""
        qkv, z, b, a = self.split_in_proj(torch.mv(self.in_proj, h))
        qkv, conv = causal_conv_step(qkv, conv, self.conv_w, None)
        q, k, v = self.split_qkv(qkv)
        beta, g = self.gates(b, a)
        ssm = torch.exp(g).view(-1, 1, 1) * ssm
        predicted = torch.matmul(ssm, k.unsqueeze(-1)).squeeze(-1)  # [Hv, Dv]
        delta = beta.unsqueeze(-1) * (v - predicted)
        ssm = ssm + delta.unsqueeze(-1) * k.unsqueeze(-2)
        o = torch.matmul(ssm, q.unsqueeze(-1)).squeeze(-1)  # [Hv, Dv]
        return self.norm_gate_out(o, z), conv, ssm
