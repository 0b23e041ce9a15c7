"""Batch invariance of the paged engine's prefill: a prompt's state in its blocks, its last
logits and its first token are the same bits computed alone and beside other prompts' chunks in
one forward (`prefill_batch`), at any place in the step, chunk after chunk, for every family and
the checkpoint variants it serves; and the negative
control: with `batch_invariant=False` (the chunks packed, one GEMM over them) the same
comparison finds a difference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from shared.cache.model_views import torch_dtype
from shared.engine.hf.engine import read_state
from shared.engine.paged.engine import PagedEngine, PagedPrefillRun
from shared.engine.paged.families import SUPPORTED_FAMILIES
from shared.engine.paged_state import PagedStateStore
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import PrefillChunk, RequestBlocks
from tests.unit.engine_batched.helpers import BlockPool, paged_engine, prompt_of
from tests.unit.engine_batched.variants import PAGED_VARIANTS

CHUNK = 16  # --prefill-chunk-tokens: the target's 41 tokens take three steps
TARGET = prompt_of(41, salt=99)


def _state(engine: PagedEngine, blocks: RequestBlocks, length: int) -> list[Tensor]:
    spec = engine.spec
    dtypes = (torch_dtype(spec.kv_dtype), torch_dtype(spec.conv_dtype), torch_dtype(spec.ssm_dtype))
    state = read_state(PagedStateStore(engine.layout, engine.ranks, blocks), spec, length, dtypes)
    return [t for kv in state.kv.values() for t in kv] + [t for cs in state.ssm.values() for t in cs]


def _target(directory: str, dtype: str, others: int, invariant: bool) -> tuple[list[Tensor], Tensor, int | None]:
    """The target's state, last logits and first token, its chunks computed in steps beside
    `others` other runs (prompts of 1..60 tokens, so they end at different steps), the target in
    the middle of each step."""
    engine = paged_engine(directory, dtype=dtype, invariant=invariant, chunk=CHUNK)
    pool = BlockPool(engine.layout)
    prompts = [prompt_of(1 + (13 * i) % 60, salt=i) for i in range(others)]
    prompts.insert(others // 2, TARGET)
    blocks = [pool.blocks(len(p), f"r{i}") for i, p in enumerate(prompts)]
    runs = [engine.start_prefill(p, b) for p, b in zip(prompts, blocks)]
    ends = [chunk_ends(0, engine.num_prefill_tokens(len(p)), CHUNK) for p in prompts]
    firsts: dict[int, int | None] = {}
    step = 0
    while any(step < len(e) for e in ends):
        live = [i for i, e in enumerate(ends) if step < len(e)]
        got = engine.prefill_batch([PrefillChunk(runs[i], ends[i][step]) for i in live])
        firsts.update(zip(live, got))
        step += 1
    at = others // 2
    target: PagedPrefillRun = runs[at]
    assert target.last_logits is not None
    n = engine.num_prefill_tokens(len(TARGET))
    return _state(engine, blocks[at], n), target.last_logits.clone(), firsts[at]


def _assert_invariant(directory: str, dtype: str) -> None:
    state, logits, first = _target(directory, dtype, 0, True)
    for others in (1, 2, 6, 17):
        b_state, b_logits, b_first = _target(directory, dtype, others, True)
        assert b_first == first, (directory, dtype, others)
        assert torch.equal(b_logits, logits), (directory, dtype, others)
        assert len(b_state) == len(state)
        for i, (a, b) in enumerate(zip(state, b_state)):
            assert torch.equal(a, b), (directory, dtype, others, i)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_prefill_does_not_depend_on_the_batch(family: str, dtype: str, hf_checkpoint: Callable[[str], str]) -> None:
    _assert_invariant(hf_checkpoint(family), dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", PAGED_VARIANTS)
def test_prefill_with_routed_experts_and_scaled_rope_does_not_depend_on_the_batch(
    variant: str, dtype: str, variant_checkpoint: Callable[[str], str]
) -> None:
    _assert_invariant(variant_checkpoint(variant), dtype)


def test_alone_equals_the_engines_own_prefill(hf_checkpoint: Callable[[str], str]) -> None:
    """`prefill` (what a colocated run and check_state compute) writes the bits a step writes."""
    directory = hf_checkpoint(SUPPORTED_FAMILIES[0])
    state, _, first = _target(directory, "fp32", 3, True)
    engine = paged_engine(directory, invariant=True, chunk=CHUNK)
    blocks = BlockPool(engine.layout).blocks(len(TARGET))
    assert engine.prefill(TARGET, blocks) == first
    n = engine.num_prefill_tokens(len(TARGET))
    assert all(torch.equal(a, b) for a, b in zip(state, _state(engine, blocks, n)))
    assert engine.check_state(TARGET, n, blocks) == []


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_negative_control_packed_chunks_are_not_invariant(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    state, logits, _ = _target(directory, "fp32", 0, False)
    differs = []
    for others in (2, 6, 17):
        b_state, b_logits, _ = _target(directory, "fp32", others, False)
        differs.append(not torch.equal(logits, b_logits) or any(not torch.equal(a, b) for a, b in zip(state, b_state)))
    assert any(differs), "packed chunks gave every batch the same bits: the invariance test could not fail"
