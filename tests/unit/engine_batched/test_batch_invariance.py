"""Batch invariance of the paged engine's decode: a request's logits are the same bits alone
and beside 1..63 other requests of other prompt lengths, at any place in the batch, step after
step, for every family and for the checkpoint variants it serves (Nemotron-H's routed experts,
scaled RoPE); and the negative controls: with `batch_invariant=False`, or with only the routed
experts' GEMMs untiled and their rows unpadded, the same comparison finds a difference (one
GEMM rounds differently with its row count)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged import ffn
from shared.engine.paged.families import SUPPORTED_FAMILIES
from shared.engine.paged.tiles import TILE_ROWS
from tests.unit.engine_batched.helpers import BlockPool, logits_of, paged_engine, prompt_of, start
from tests.unit.engine_batched.variants import PAGED_VARIANTS, ROUTED_VARIANTS

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


def _assert_invariant(directory: str, dtype: str) -> None:
    alone = _target_logits(directory, dtype, 1, True)
    for batch in BATCH_SIZES[1:]:
        beside = _target_logits(directory, dtype, batch, True)
        for step, (a, b) in enumerate(zip(alone, beside)):
            assert torch.equal(a, b), (directory, dtype, batch, step)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_logits_do_not_depend_on_the_batch(family: str, dtype: str, hf_checkpoint: Callable[[str], str]) -> None:
    _assert_invariant(hf_checkpoint(family), dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", PAGED_VARIANTS)
def test_routed_experts_and_scaled_rope_do_not_depend_on_the_batch(
    variant: str, dtype: str, variant_checkpoint: Callable[[str], str]
) -> None:
    _assert_invariant(variant_checkpoint(variant), dtype)


@pytest.mark.parametrize("variant", ROUTED_VARIANTS)
def test_negative_control_experts_in_one_gemm_depend_on_their_other_rows(
    variant: str, variant_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The feed-forward GEMMs untiled (ffn.linear: one GEMM over the rows each call gets) and
    the routed experts' rows unpadded (ffn.stack_rows: the rows routed, as many as there are):
    the target's logits then depend on which requests share its step. A step of at most
    TILE_ROWS requests is one stack, so the shared experts and latent projections see one shape
    whatever the batch: only the routed experts, whose row counts follow the batch, can make the
    difference (these variants have no dense MLP layer)."""
    directory = variant_checkpoint(variant)
    monkeypatch.setattr(ffn, "linear", lambda x, w, b=None, *, invariant=False: F.linear(x, w, b))
    monkeypatch.setattr(ffn, "stack_rows", lambda rows, dtype: rows)
    alone = _target_logits(directory, "fp32", 1, True)
    differs = []
    for batch in (2, 7, TILE_ROWS):
        beside = _target_logits(directory, "fp32", batch, True)
        differs.append(any(not torch.equal(a, b) for a, b in zip(alone, beside)))
    assert any(differs), "untiled expert GEMMs gave every batch the same bits: the invariance test could not fail"


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_negative_control_one_gemm_is_not_invariant(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    alone = _target_logits(directory, "fp32", 1, False)
    differs = []
    for batch in (2, 7, 33):
        beside = _target_logits(directory, "fp32", batch, False)
        differs.append(any(not torch.equal(a, b) for a, b in zip(alone, beside)))
    assert any(differs), "one GEMM over the batch gave every batch size the same bits: the invariance test could not fail"
