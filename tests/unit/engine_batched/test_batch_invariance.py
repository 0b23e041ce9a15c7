"""Batch invariance of the paged engine's decode: a request's logits are the same bits alone
and beside 1..63 other requests of other prompt lengths, at any place in the batch, step after
step; and the negative control: with `batch_invariant=False` the same comparison finds a
difference (one GEMM over the batch rounds differently with its row count)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from shared.engine.paged.families import SUPPORTED_FAMILIES
from tests.unit.engine_batched.helpers import BlockPool, logits_of, paged_engine, prompt_of, start

BATCH_SIZES = (1, 2, 3, 7, 16, 33, 64)
STEPS = 3
TARGET = prompt_of(11, salt=99)


def _target_logits(directory: str, dtype: str, batch: int, invariant: bool) -> list[Tensor]:
    """The target request's logits per step, stepped with `batch - 1` others (prompts of 1..23
    tokens), the target placed in the middle of the batch."""
    engine = paged_engine(directory, dtype=dtype, invariant=invariant)
    pool = BlockPool(engine.layout)
    sessions = [start(engine, pool, prompt_of(1 + (5 * i) % 23, salt=i), f"r{i}")[0] for i in range(batch - 1)]
    where = batch // 2
    target, _ = start(engine, pool, TARGET, "target")
    sessions.insert(where, target)
    out = []
    for _ in range(STEPS):
        engine.step_batch(sessions)
        out.append(logits_of(target))
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_logits_do_not_depend_on_the_batch(family: str, dtype: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    alone = _target_logits(directory, dtype, 1, True)
    for batch in BATCH_SIZES[1:]:
        beside = _target_logits(directory, dtype, batch, True)
        for step, (a, b) in enumerate(zip(alone, beside)):
            assert torch.equal(a, b), (family, dtype, batch, step)


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_negative_control_one_gemm_is_not_invariant(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    alone = _target_logits(directory, "fp32", 1, False)
    differs = []
    for batch in (2, 7, 33):
        beside = _target_logits(directory, "fp32", batch, False)
        differs.append(any(not torch.equal(a, b) for a, b in zip(alone, beside)))
    assert any(differs), "one GEMM over the batch gave every batch size the same bits: the invariance test could not fail"
