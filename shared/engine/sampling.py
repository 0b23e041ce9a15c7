"""Per-request sampling: greedy by default; temperature, top-k, top-p and a seed.

Reproducible across processes and machines: the draw for output token `index` of a request
uses its own generator seeded from (seed, index), on the CPU in fp32, so prefill sampling the
first token and decode sampling the rest give exactly the tokens a colocated run gives.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor


class SamplingError(ValueError):
    """A bad sampling value; `field` names the parameter (temperature, top_p, top_k, seed)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.detail = message


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0: every token
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise SamplingError("seed", f"must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def _generator(seed: int, index: int) -> torch.Generator:
    mixed = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(mixed[:8], "little") & (2**63 - 1))


def sample(logits: Tensor, params: SamplingParams, index: int) -> int:
    """The token at output position `index` (0: the first generated token) from `logits` [vocab]."""
    scores = logits.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
    if params.greedy:
        return int(torch.argmax(scores))
    scores = scores / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1:
        order = torch.argsort(scores, descending=True, stable=True)
        probs = torch.softmax(scores[order], dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        scores[order[drop]] = -math.inf
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=_generator(params.seed, index)))
