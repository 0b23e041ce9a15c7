"""The Gated DeltaNet mixer (Qwen3-Next, Qwen3.5) on explicit states: conv `[C, K-1]` over
`[q | k | v]`, recurrent state `[Hv, Dv, Dk]` in fp32 (the layout's orientation, kept in the
computation so every sum runs over the innermost dim).

Prefill runs the gated delta rule over a chunk in blocks from any state (delta_rule.py); a
decode step runs it token by token for a tile of requests at once (the per-head work on the
tile's rows, the state update on the real requests only: products and sums over Dk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.conv_step import conv_step
from shared.engine.paged.delta_rule import chunked_delta_rule
from shared.engine.paged.tiles import linear


@dataclass
class GatedDeltaNet:
    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("in_qkvz", "in_ba", "in_qkv", "in_z", "in_b", "in_a", "out_proj")

    conv_weight: Tensor  # [C, K], no bias
    A_log: Tensor  # fp32 [Hv]
    dt_bias: Tensor  # [Hv]
    norm_weight: Tensor  # [Dv]
    out_proj: Tensor
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    norm_eps: float
    # Qwen3-Next: fused, interleaved per key head; Qwen3.5: one projection per quantity.
    in_qkvz: Tensor | None = None
    in_ba: Tensor | None = None
    in_qkv: Tensor | None = None
    in_z: Tensor | None = None
    in_b: Tensor | None = None
    in_a: Tensor | None = None

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.num_v_heads, self.head_v_dim, self.head_k_dim)

    def _project(self, h: Tensor, invariant: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """qkv [rows, C] (canonical order), z [rows, Hv, Dv], b and a [rows, Hv]."""
        rows, hk, dk, dv = h.shape[0], self.num_k_heads, self.head_k_dim, self.head_v_dim
        if self.in_qkvz is not None and self.in_ba is not None:
            r = self.num_v_heads // hk
            qkvz = linear(h, self.in_qkvz, invariant=invariant).view(rows, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=2)
            b, a = torch.split(linear(h, self.in_ba, invariant=invariant).view(rows, hk, 2 * r), [r, r], dim=2)
            qkv = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], dim=-1)
            return qkv, z.reshape(rows, self.num_v_heads, dv), b.reshape(rows, -1), a.reshape(rows, -1)
        assert self.in_qkv is not None and self.in_z is not None and self.in_b is not None and self.in_a is not None
        qkv = linear(h, self.in_qkv, invariant=invariant)
        z = linear(h, self.in_z, invariant=invariant).view(rows, self.num_v_heads, dv)
        return qkv, z, linear(h, self.in_b, invariant=invariant), linear(h, self.in_a, invariant=invariant)

    def _inputs(self, mixed: Tensor, b: Tensor, a: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """From the conv output [rows, C]: q, k [rows, Hv, Dk] (l2-normalised, q scaled), v
        [rows, Hv, Dv], all fp32, and the decay exp(g) and beta [rows, Hv] (fp32)."""
        rows, kd = mixed.shape[0], self.num_k_heads * self.head_k_dim
        q, k, v = torch.split(mixed, [kd, kd, self.num_v_heads * self.head_v_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = _per_value_head(q.reshape(rows, self.num_k_heads, self.head_k_dim), rep).float()
        k = _per_value_head(k.reshape(rows, self.num_k_heads, self.head_k_dim), rep).float()
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        q = q / (self.head_k_dim**0.5)
        beta = torch.sigmoid(b).float()
        return q, k, v.reshape(rows, self.num_v_heads, self.head_v_dim).float(), self._log_decay(a).exp(), beta

    def _finish(self, o: Tensor, z: Tensor, dtype: torch.dtype, invariant: bool) -> Tensor:
        """Per-head RMS norm over Dv (norm before gate), times silu(z), then out_proj."""
        rows = o.shape[0]
        h = o.to(dtype).to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        h = self.norm_weight * h.to(dtype)
        h = (h * F.silu(z.to(torch.float32))).to(dtype)
        return linear(h.reshape(rows, -1), self.out_proj, invariant=invariant)

    def prefill(self, h: Tensor, conv: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`h` [T, hidden] after `conv` [C, K-1] and `ssm` [Hv, Dv, Dk]: output, new states."""
        dtype = h.dtype
        qkv, z, b, a = self._project(h, False)
        window = torch.cat([conv.to(dtype), qkv.transpose(0, 1)], dim=1)
        new_conv = window[:, -(self.conv_weight.shape[1] - 1) :].contiguous()
        mixed = F.silu(F.conv1d(window[None], self.conv_weight[:, None, :], None, groups=self.conv_dim)[0]).transpose(0, 1)
        q, k, v, _, beta = self._inputs(mixed, b, a)
        o, state = chunked_delta_rule(q, k, v, self._log_decay(a), beta, ssm)
        return self._finish(o, z, dtype, False), new_conv, state

    def _log_decay(self, a: Tensor) -> Tensor:
        """g [rows, Hv] (fp32), the log of `_inputs`' decay: the blocked rule sums it."""
        return -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)

    def step(
        self, h: Tensor, conv: Tensor, ssm: Tensor, fresh: Tensor | None, *, invariant: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`h` [R, hidden] (the first n = len(ssm) rows real), `conv` [n, C, K-1], `ssm` [n, Hv, Dv, Dk]."""
        del fresh  # no clamp in this recurrence
        r, n, dtype = h.shape[0], ssm.shape[0], h.dtype
        qkv, z, b, a = self._project(h, invariant)
        window = torch.cat([conv.to(dtype), qkv[:n, :, None]], dim=2)
        mixed = F.silu(conv_step(window, self.conv_weight, None, r))
        q, k, v, decay, beta = self._inputs(mixed, b, a)
        new_ssm, o_real = _delta_step(ssm, q[:n], k[:n], v[:n], decay[:n], beta[:n])
        o = o_real.new_zeros((r, self.num_v_heads, self.head_v_dim))
        o[:n] = o_real
        return self._finish(o, z, dtype, invariant), window[:, :, 1:], new_ssm


def _per_value_head(t: Tensor, rep: int) -> Tensor:
    """[rows, Hk, D] -> [rows, Hk * rep, D]: value head j uses key head j // rep."""
    rows, hk, d = t.shape
    return t[:, :, None, :].expand(rows, hk, rep, d).reshape(rows, hk * rep, d)


def _delta_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """One token of the gated delta rule for rows of requests: state [n, Hv, Dv, Dk] (fp32),
    q and k [n, Hv, Dk], v [n, Hv, Dv], decay and beta [n, Hv]. New state and output [n, Hv, Dv]."""
    state = state * decay[:, :, None, None]
    remembered = (state * k[:, :, None, :]).sum(-1)  # S k: what the state says for key k
    delta = (v - remembered) * beta[:, :, None]
    state = state + delta[:, :, :, None] * k[:, :, None, :]
    return state, (state * q[:, :, None, :]).sum(-1)
