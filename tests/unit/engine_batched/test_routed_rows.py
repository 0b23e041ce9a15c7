"""A routed expert's rows (ffn.py): their count follows the batch, so an invariant expert pads
them to a whole stack; a token's output is then the same bits whatever else its batch routes to
its experts, at an expert width whose activation has a scalar tail (24 fp32 values); and the
negative control: without the padding the same comparison finds a difference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged import ffn
from shared.engine.paged.ffn import Mlp, Moe
from shared.engine.paged.routers import SoftmaxRouter

HIDDEN, WIDTH, EXPERTS = 64, 24, 4


def _moe() -> Moe:
    g = torch.Generator().manual_seed(6)
    experts = [
        Mlp(up=torch.randn(WIDTH, HIDDEN, generator=g) / 8, down=torch.randn(HIDDEN, WIDTH, generator=g) / 5, act=F.silu)
        for _ in range(EXPERTS)
    ]
    router = SoftmaxRouter(weight=torch.randn(EXPERTS, HIDDEN, generator=g), top_k=2, softmax_after_topk=False)
    return Moe(router=router, experts=experts)


def _first_rows_differ(moe: Moe) -> list[int]:
    """The batch sizes at which the first 2 tokens get other bits than in a batch of 2."""
    x = 3 * torch.randn(48, HIDDEN, generator=torch.Generator().manual_seed(7))
    first: Tensor = moe(x[:2], invariant=True)
    return [n for n in range(3, 49) if not torch.equal(moe(x[:n], invariant=True)[:2], first)]


def test_a_tokens_experts_give_it_the_same_bits_in_any_batch() -> None:
    assert _first_rows_differ(_moe()) == []


def test_negative_control_unpadded_expert_rows_depend_on_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("measured on AVX-512's 32-value steps")
    monkeypatch.setattr(ffn, "stack_rows", lambda rows, dtype: rows)
    assert _first_rows_differ(_moe()) != []
