"""Routers of the mixtures of experts: which experts each token goes to, and with what weight.

A router looks at one row at a time (its logits come from `linear`'s tiles), so a token's
experts and weights never depend on the other rows of the batch. Weights are returned in fp32;
the `Moe` (ffn.py) decides in which dtype they multiply the experts' outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from shared.engine.paged.tiles import linear


class Router(Protocol):
    def __call__(self, h: Tensor, *, invariant: bool) -> tuple[Tensor, Tensor]:
        """Weights [rows, top_k] (fp32) and expert ids [rows, top_k] of the rows of `h`."""
        ...


@dataclass
class SoftmaxRouter:
    """Softmax over the router logits then top-k, or top-k then softmax (Granite); Qwen
    renormalises the top-k probabilities."""

    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("weight",)

    weight: Tensor  # [E, hidden]
    top_k: int
    softmax_after_topk: bool
    normalize_topk: bool = False

    def __call__(self, h: Tensor, *, invariant: bool) -> tuple[Tensor, Tensor]:
        logits = linear(h, self.weight, invariant=invariant).float()
        if self.softmax_after_topk:
            top, index = logits.topk(self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), index
        weights, index = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        if self.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, index


@dataclass
class GroupedSigmoidRouter:
    """Nemotron-H's router (DeepSeek-V3's): sigmoid scores from fp32 logits; experts are chosen
    by the scores plus a correction bias, first the `topk_group` best groups (a group scores the
    sum of its best two), then the best `top_k` experts inside them; a chosen expert weighs its
    uncorrected score, optionally renormalised, times `scaling`."""

    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("weight",)

    weight: Tensor  # [E, hidden], fp32 (transformers keeps it in fp32 in any dtype)
    correction_bias: Tensor  # [E], fp32
    top_k: int
    num_groups: int
    topk_groups: int
    normalize_topk: bool
    scaling: float

    def __call__(self, h: Tensor, *, invariant: bool) -> tuple[Tensor, Tensor]:
        scores = linear(h.float(), self.weight, invariant=invariant).sigmoid()
        choice = scores + self.correction_bias
        rows, experts = choice.shape
        group_scores = choice.view(rows, self.num_groups, experts // self.num_groups).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.num_groups, experts // self.num_groups).reshape(rows, experts)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        index = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if self.normalize_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, index
