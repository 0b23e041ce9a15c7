"""Parameter declarations and their seeded initialisers.

Each layer declares its parameters as `name -> ParamSpec(shape, init)`; `weights.py` draws them
all from one CPU generator in sorted-name order. Inits follow Mamba / GDN practice
(hybrid-models.md 3.3) so that the recurrent state carries real information: decays close to
one for some heads, fast for others.

The ranges below are tuned, within the spirit of those inits, so that the state a transfer
carries visibly drives the next tokens: every negative control (negative_controls.py) must
change the greedy tokens of typical prompts for every tiny preset. Standard Mamba inits
(dt in [1e-3, 1e-1], A in [1, 16], D = 1) leave the skip path dominant at these tiny widths,
so zeroing the SSM state often changed nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from shared.engine.reference.numerics import inverse_softplus

Shape = tuple[int, ...]
Init = Callable[[torch.Generator, Shape], Tensor]


@dataclass(frozen=True)
class ParamSpec:
    shape: Shape
    init: Init


def normal(std: float) -> Init:
    def draw(gen: torch.Generator, shape: Shape) -> Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    return draw


def linear(fan_in: int, gain: float = 1.0) -> Init:
    """Gaussian weights with std gain/sqrt(fan_in): unit-scale outputs for unit-scale inputs."""
    return normal(gain / math.sqrt(fan_in))


def uniform(low: float, high: float) -> Init:
    def draw(gen: torch.Generator, shape: Shape) -> Tensor:
        return low + (high - low) * torch.rand(shape, generator=gen, dtype=torch.float32)

    return draw


def constant(value: float) -> Init:
    def draw(gen: torch.Generator, shape: Shape) -> Tensor:
        return torch.full(shape, value, dtype=torch.float32)

    return draw


def log_uniform_a(low: float, high: float) -> Init:
    """A_log = log(U[low, high]) so that A = -exp(A_log) spans slow and fast decays."""

    def draw(gen: torch.Generator, shape: Shape) -> Tensor:
        return torch.log(uniform(low, high)(gen, shape))

    return draw


def dt_bias(dt_min: float = 1e-2, dt_max: float = 1.0, floor: float = 1e-4) -> Init:
    """Bias whose softplus is dt, dt drawn log-uniform in [dt_min, dt_max] (Mamba init)."""

    def draw(gen: torch.Generator, shape: Shape) -> Tensor:
        u = torch.rand(shape, generator=gen, dtype=torch.float32)
        dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp_min(floor)
        return inverse_softplus(dt)

    return draw


def conv_weight(kernel: int) -> Init:
    """Depthwise conv taps, PyTorch's default bound 1/sqrt(fan_in) with fan_in = K."""
    bound = 1.0 / math.sqrt(kernel)
    return uniform(-bound, bound)
