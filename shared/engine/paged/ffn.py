"""Feed-forward blocks: plain and gated MLPs, and top-k mixtures of experts.

Experts run on the rows routed to them, gathered per expert (one pass per expert); in decode
those row counts depend on the batch, so every expert matmul goes through `linear`'s tiles
(tiles.py), an invariant expert's rows are padded to a whole stack (its activation then has no
scalar tail whatever the count), and each token sums its experts' outputs in its own top-k
order, which no other row changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.routers import Router
from shared.engine.paged.tiles import linear, pad_rows, padding_after, stack_rows

Activation = Callable[[Tensor], Tensor]


def relu2(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS: dict[str, Activation] = {"silu": F.silu, "relu2": relu2, "gelu": F.gelu, "relu": F.relu}


def activation(name: str) -> Activation:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not implemented by the paged engine") from None


@dataclass
class Mlp:
    """`down(act(up x))`, or gated `down(act(gate x) * up x)` when `gate` is set. A fused
    `up` of both halves (Granite's input_linear: [gate | up]) is split with `fused_gate`."""

    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("up", "gate", "down")

    up: Tensor
    down: Tensor
    act: Activation
    gate: Tensor | None = None
    fused_gate: bool = False
    gate_scale: float = 1.0  # Falcon-H1's mlp_multipliers: on the gate projection
    down_scale: float = 1.0  # ... and on the output

    def __call__(self, h: Tensor, *, invariant: bool) -> Tensor:
        if self.fused_gate:
            g, u = linear(h, self.up, invariant=invariant).chunk(2, dim=-1)
            return linear(self.act(g) * u, self.down, invariant=invariant)
        u = linear(h, self.up, invariant=invariant)
        if self.gate is None:
            u = self.act(u)
        else:
            g = linear(h, self.gate, invariant=invariant)
            u = u * self.act(g * self.gate_scale if self.gate_scale != 1.0 else g)
        out = linear(u, self.down, invariant=invariant)
        return out * self.down_scale if self.down_scale != 1.0 else out


@dataclass
class Moe:
    """Top-k routed experts (the `router` picks them, routers.py) plus optional shared experts
    (with an optional sigmoid gate, Qwen3-Next). Nemotron-H weighs and sums the routed outputs in
    fp32 and may run its experts in a smaller latent width (`latent_in`, `latent_out`)."""

    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("latent_in", "latent_out", "shared_gate")

    router: Router
    experts: list[Mlp]
    shared: Mlp | None = None
    shared_gate: Tensor | None = None  # [1, hidden]
    weights_in_fp32: bool = False
    latent_in: Tensor | None = None  # [latent, hidden]
    latent_out: Tensor | None = None  # [hidden, latent]

    def __call__(self, h: Tensor, *, invariant: bool) -> Tensor:
        weights, index = self.router(h, invariant=invariant)
        x = h if self.latent_in is None else linear(h, self.latent_in, invariant=invariant)
        # Experts in id order per token, summed from zero, as transformers' index_add_ does.
        index, order = index.sort(dim=-1)
        weights = weights.gather(-1, order)
        if not self.weights_in_fp32:
            weights = weights.to(h.dtype)
        top_k = index.shape[1]
        outs = x.new_zeros((x.shape[0], top_k, x.shape[1]), dtype=weights.dtype)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            if token.numel():
                outs[token, slot] = _routed(expert, x[token], invariant) * weights[token, slot, None]
        out = outs[:, 0]
        for k in range(1, top_k):
            out = out + outs[:, k]
        out = out.to(h.dtype)
        if self.latent_out is not None:
            out = linear(out, self.latent_out, invariant=invariant)
        if self.shared is not None:
            s = self.shared(h, invariant=invariant)
            if self.shared_gate is not None:
                s = torch.sigmoid(linear(h, self.shared_gate, invariant=invariant)) * s
            out = out + s
        return out


def _routed(expert: Mlp, x: Tensor, invariant: bool) -> Tensor:
    """`expert(x)` on the rows routed to it. Their count follows the batch, so with `invariant`
    they are padded to a whole stack (tiles.stack_rows), which leaves the expert's activation no
    scalar tail at any width, and its GEMMs skip the tiles of only padding."""
    if not invariant:
        return expert(x, invariant=False)
    count = x.shape[0]
    rows = stack_rows(count, x.dtype)
    with padding_after(count, rows):
        return expert(pad_rows(x, rows), invariant=True)[:count]
