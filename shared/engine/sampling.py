"""Per-request sampling: greedy by default; temperature, top-k, top-p, a seed and min_tokens.

Reproducible across processes and machines: the draw for output token `index` of a request
uses its own generator seeded from (seed, index), on the CPU in fp32, so prefill sampling the
first token and decode sampling the rest give exactly the tokens a colocated run gives.

min_tokens (vLLM's semantics): before output index min_tokens the ids that would end the
generation (EOS unless ignore_eos, and the request's stop ids) get logit -inf, before greedy,
top-k, top-p or the seeded draw, so they cannot be picked.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

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
    min_tokens: int = 0  # output tokens drawn with `stop_token_ids` masked
    # The ids that end this generation; masked only while index < min_tokens (see `masked`).
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise SamplingError("seed", f"must be in [0, 2**64), got {self.seed}")
        if self.min_tokens < 0:
            raise SamplingError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids", f"must be token ids >= 0, got {sorted(self.stop_token_ids)[:4]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def with_min_tokens(params: SamplingParams, min_tokens: int, stop_token_ids: frozenset[int]) -> SamplingParams:
    """`params` that keep `stop_token_ids` from being drawn before `min_tokens` tokens; `params`
    itself when nothing is masked (so a plain greedy request stays GREEDY)."""
    if min_tokens == 0 or not stop_token_ids:
        return params
    return replace(params, min_tokens=min_tokens, stop_token_ids=frozenset(int(t) for t in stop_token_ids))


def leaves_a_token(params: SamplingParams, vocab_size: int) -> bool:
    """False when min_tokens masks every id of the vocabulary: all logits would be -inf and the
    draw undefined, so such a request is refused before it runs."""
    return params.min_tokens == 0 or len({t for t in params.stop_token_ids if t < vocab_size}) < vocab_size


def masks_stop_ids(params: SamplingParams, index: int) -> bool:
    """Whether the draw of output index `index` masks the stop ids (below min_tokens)."""
    return index < params.min_tokens and bool(params.stop_token_ids)


def masked(logits: Tensor, params: SamplingParams, index: int) -> Tensor:
    """`logits` [vocab] (fp32, CPU, a copy when changed) with the stop ids at -inf while output
    index `index` is below min_tokens; `logits` itself otherwise."""
    if not masks_stop_ids(params, index):
        return logits
    ids = torch.tensor(sorted(t for t in params.stop_token_ids if t < logits.numel()), dtype=torch.long)
    out = logits.detach().to(device="cpu", dtype=torch.float32).reshape(-1).clone()
    out[ids] = -math.inf
    return out


def first_draw(params: SamplingParams) -> SamplingParams:
    """What the draw of output index 0 depends on besides the logits, as parameters that draw
    it alike (`sample(logits, first_draw(p), 0) == sample(logits, p, 0)`): greedy ignores top_p,
    top_k and the seed; the stop ids are masked at index 0 only when min_tokens >= 1, and how far
    past 1 min_tokens goes never matters there. Equal results: the same first token."""
    mask = params.stop_token_ids if params.min_tokens >= 1 else frozenset()
    at_first = 1 if mask else 0
    if params.greedy:
        return SamplingParams(min_tokens=at_first, stop_token_ids=mask)
    return replace(params, min_tokens=at_first, stop_token_ids=mask)


def _generator(seed: int, index: int) -> torch.Generator:
    mixed = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(mixed[:8], "little") & (2**63 - 1))


def draws_argmax(params: SamplingParams, index: int) -> bool:
    """Whether `sample(logits, params, index)` is the argmax of `logits` as they are (greedy,
    nothing masked at this index): rows of many requests can then take one argmax together."""
    return params.greedy and not masks_stop_ids(params, index)


def argmax_rows(logits: Tensor) -> list[int]:
    """The argmax of each row of `logits` [rows, vocab], as `sample` takes it for one row (in
    fp32 on the CPU, the first of equal maxima)."""
    return [int(t) for t in torch.argmax(logits.detach().to(device="cpu", dtype=torch.float32), dim=-1).tolist()]


def sample(logits: Tensor, params: SamplingParams, index: int) -> int:
    """The token at output position `index` (0: the first generated token) from `logits` [vocab]."""
    scores = masked(logits.detach().to(device="cpu", dtype=torch.float32).reshape(-1), params, index)
    if params.greedy:
        return int(torch.argmax(scores))
    scaled = scores / params.temperature
    if bool(torch.isnan(scaled).any() or torch.isposinf(scaled).any()):
        # A temperature so small that the scores overflow fp32: its limit, the greedy token.
        return int(torch.argmax(scores))
    scores = scaled
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1:
        order = torch.argsort(scores, descending=True, stable=True)
        probs = torch.softmax(scores[order], dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False  # also when top_p is below fp32's smallest number (0 there): the likeliest stays
        scores[order[drop]] = -math.inf
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=_generator(params.seed, index)))
