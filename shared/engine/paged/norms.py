"""RMS norms as the families compute them (the casts decide the bf16 bits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, weight_in_fp32: bool = False, offset: float = 0.0) -> Tensor:
    """Normalise the last dim in fp32. `weight_in_fp32`: the weight multiplies before the cast
    back (Nemotron-H, Qwen3-Next's `1 + w`); else after (Llama style: Bamba, Granite, Jamba)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(torch.float32) + offset if offset else weight
    if weight_in_fp32 or offset:
        return (w.to(torch.float32) * h).to(dtype)
    return weight * h.to(dtype)


def gated_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, eps: float, groups: int) -> Tensor:
    """Mamba2's norm (norm_before_gate False): `y * silu(gate)`, RMS-normalised within each of
    `groups` equal groups of the last dim, times `weight`; the cast back precedes the weight."""
    dtype = y.dtype
    h = y.to(torch.float32) * F.silu(gate.to(torch.float32))
    shape = h.shape
    g = h.view(*shape[:-1], groups, shape[-1] // groups)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(shape).to(dtype)


def falcon_gated_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, eps: float, groups: int, *, before_gate: bool) -> Tensor:
    """Falcon-H1's Mamba2 norm: grouped RMS norm whose weight multiplies in fp32, the gate
    applied before (`before_gate` False) or after it, one cast back at the end."""
    dtype = y.dtype
    h = y if before_gate else y * F.silu(gate.to(torch.float32))
    h = h.to(torch.float32)
    shape = h.shape
    g = h.view(*shape[:-1], groups, shape[-1] // groups)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    h = (weight.view(groups, shape[-1] // groups) * g).view(shape)
    if before_gate:
        h = h * F.silu(gate.to(torch.float32))
    return h.to(dtype)
