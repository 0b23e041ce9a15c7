"""Batch invariance of the paged prefill for chunks longer than one block of its kernels: a
150-token prompt computed as one chunk spans several query blocks of its attention
(chunk_attention.QUERY_BLOCK), Mamba1 segments (selective_scan.SEGMENT), GDN blocks
(delta_rule.BLOCK) and SSD blocks, and its state and last logits are the same bits alone and
beside other prompts' chunks of other lengths in one forward. Negative control: with
`batch_invariant=False` (the chunks packed, one GEMM over them) the comparison finds a difference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from shared.cache.model_views import torch_dtype
from shared.engine.hf.engine import read_state
from shared.engine.paged.chunk_attention import QUERY_BLOCK
from shared.engine.paged.delta_rule import BLOCK
from shared.engine.paged.engine import PagedEngine
from shared.engine.paged.selective_scan import SEGMENT
from shared.engine.paged_state import PagedStateStore
from shared.engine.protocol import PrefillChunk, RequestBlocks
from tests.unit.engine_batched.helpers import BlockPool, paged_engine, prompt_of

TARGET = prompt_of(150, salt=7)
OTHERS = (1, 20, 70, 131)  # prompt lengths computed beside it
FAMILIES = ("nemotron_h", "jamba", "qwen3_5")  # Mamba2, Mamba1 and GDN, each beside attention


def _state(engine: PagedEngine, blocks: RequestBlocks, length: int) -> list[Tensor]:
    spec = engine.spec
    dtypes = (torch_dtype(spec.kv_dtype), torch_dtype(spec.conv_dtype), torch_dtype(spec.ssm_dtype))
    state = read_state(PagedStateStore(engine.layout, engine.ranks, blocks), spec, length, dtypes)
    return [t for kv in state.kv.values() for t in kv] + [t for cs in state.ssm.values() for t in cs]


def _target(directory: str, dtype: str, others: tuple[int, ...], invariant: bool) -> tuple[list[Tensor], Tensor]:
    """The target's state and last logits, its whole prompt one chunk in one forward beside
    one whole-prompt chunk of each length in `others` (the target in the middle)."""
    engine = paged_engine(directory, dtype=dtype, invariant=invariant)
    pool = BlockPool(engine.layout)
    prompts = [prompt_of(n, salt=i) for i, n in enumerate(others)]
    at = len(prompts) // 2
    prompts.insert(at, TARGET)
    blocks = [pool.blocks(len(p), f"r{i}") for i, p in enumerate(prompts)]
    runs = [engine.start_prefill(p, b) for p, b in zip(prompts, blocks)]
    engine.prefill_batch([PrefillChunk(r, engine.num_prefill_tokens(len(p))) for r, p in zip(runs, prompts)])
    logits = runs[at].last_logits
    assert logits is not None
    return _state(engine, blocks[at], engine.num_prefill_tokens(len(TARGET))), logits.clone()


def test_the_target_spans_several_blocks_of_every_kernel() -> None:
    assert len(TARGET) > 2 * max(QUERY_BLOCK, BLOCK, SEGMENT)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_chunk_does_not_depend_on_the_batch(family: str, dtype: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    state, logits = _target(directory, dtype, (), True)
    b_state, b_logits = _target(directory, dtype, OTHERS, True)
    assert torch.equal(b_logits, logits), (family, dtype)
    assert len(b_state) == len(state)
    for i, (a, b) in enumerate(zip(state, b_state)):
        assert torch.equal(a, b), (family, dtype, i)


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_packed_chunks_are_not_invariant(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    state, logits = _target(directory, "fp32", (), False)
    b_state, b_logits = _target(directory, "fp32", OTHERS, False)
    assert not torch.equal(logits, b_logits) or any(not torch.equal(a, b) for a, b in zip(state, b_state)), (
        "packed chunks gave every batch the same bits: the invariance test could not fail"
    )
