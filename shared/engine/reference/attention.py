"""Full attention with GQA and RoPE (or NoPE), one query token against the cached K/V."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from shared.engine.reference.initializers import ParamSpec, linear
from shared.layout.spec import AttentionDims

ROPE_THETA = 10000.0


def attention_params(dims: AttentionDims, hidden: int) -> dict[str, ParamSpec]:
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    return {
        "wq": ParamSpec((q, hidden), linear(hidden)),
        "wk": ParamSpec((kv, hidden), linear(hidden)),
        "wv": ParamSpec((kv, hidden), linear(hidden)),
        "wo": ParamSpec((hidden, q), linear(q)),
    }


def rope_table(head_dim: int, max_positions: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos/sin `[max_positions, head_dim/2]`, computed once per model at one fixed shape so that
    every process gets the same bits for a given position."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cos(angles).float().to(device), torch.sin(angles).float().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on `[heads, head_dim]` with the cos/sin row of one position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention:
    """GQA: query head h reads KV head h // (num_heads / num_kv_heads)."""

    def __init__(self, dims: AttentionDims, weights: Mapping[str, Tensor]) -> None:
        self.dims = dims
        self.wq, self.wk, self.wv, self.wo = weights["wq"], weights["wk"], weights["wv"], weights["wo"]
        self.scale = 1.0 / math.sqrt(dims.head_dim)

    def project(self, h: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """q `[Hq, hd]`, k and v `[KV, hd]` of one token; RoPE applied when given."""
        d = self.dims
        q = torch.mv(self.wq, h).view(d.num_heads, d.head_dim)
        k = torch.mv(self.wk, h).view(d.num_kv_heads, d.head_dim)
        v = torch.mv(self.wv, h).view(d.num_kv_heads, d.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def attend(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """Softmax attention of one query over `[L, KV, hd]` keys/values; explicit matmuls (no SDPA,
        whose backend choice depends on length)."""
        d = self.dims
        qg = q.view(d.num_kv_heads, d.num_heads // d.num_kv_heads, d.head_dim) * self.scale
        scores = torch.matmul(qg, keys.permute(1, 2, 0))  # [KV, g, L]
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values.permute(1, 0, 2))  # [KV, g, hd]
        return torch.mv(self.wo, out.reshape(-1))
