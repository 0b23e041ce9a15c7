"""The paged engine resumes a chunked prefill at a kept chunk boundary (`ResumablePrefill`, what
prefill's boundary cache relies on): the K/V of tokens [0, b) in the leading blocks and the conv
/ SSM state kept after the chunk ending at b, restored into a fresh request's blocks, and the
chunks from b on give the state of a prefill from token 0, bit for bit. Negative controls: the
state kept at another boundary, or none restored, give other bits."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from shared.cache.block_copy import copy_blocks
from shared.engine.hf.engine import read_state
from shared.engine.paged.engine import PagedEngine
from shared.engine.paged_state import PagedStateStore
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import RequestBlocks
from shared.runtime.colocated import Colocated

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CHUNK = 20
PROMPT_LEN = 71  # full boundary: 71 computed, chunks end at 20, 40, 60, 71


def _state(engine: PagedEngine, blocks: RequestBlocks, n: int) -> list[torch.Tensor]:
    store = PagedStateStore(engine.layout, engine.ranks, blocks)
    got = read_state(store, engine.spec, n, (torch.float32, torch.float32, torch.float32))
    out: list[torch.Tensor] = []
    for layer in sorted(got.kv):
        out += list(got.kv[layer])
    for layer in sorted(got.ssm):
        out += list(got.ssm[layer])
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_a_resumed_prefill_has_the_bits_of_one_from_token_0(hf_checkpoint: Callable[[str], str], family: str) -> None:
    colocated = Colocated.build("paged", hf_checkpoint(family), 1, 64, prefill_chunk_tokens=CHUNK)
    try:
        engine = colocated.engine
        assert isinstance(engine, PagedEngine) and engine.resumes_exactly
        layout = engine.layout
        prompt = [int(t) for t in np.random.default_rng(3).integers(4, 200, PROMPT_LEN)]
        n = engine.num_prefill_tokens(len(prompt))

        # From token 0: the state every resumed run must equal.
        whole = colocated.allocate("whole", n)
        engine.prefill(prompt, whole)
        want = _state(engine, whole, n)

        # A run from token 0 keeps the state after the chunks ending at 20 and at 40.
        first = colocated.allocate("first", n)
        run = engine.start_prefill(prompt, first)
        kept: dict[int, RequestBlocks] = {}
        for end in (20, 40):
            run.compute(end)
            kept[end] = colocated.allocate(f"kept-{end}", 0)  # one block per Mamba group
            engine.keep_boundary_state(run, kept[end])

        def resumed(key: str, state_of: int | None) -> list[torch.Tensor]:
            """A fresh request resumed at 40: its attention blocks get the first run's K/V,
            its Mamba blocks the state kept at `state_of` (None: nothing restored)."""
            blocks = colocated.allocate(key, n)
            attention = [g for g, grp in enumerate(layout.groups) if grp.kind == "attention"]
            upto = -(-40 // layout.block_size)
            src = np.concatenate([first.block_ids[g][:upto] for g in attention])
            dst = np.concatenate([blocks.block_ids[g][:upto] for g in attention])
            copy_blocks(engine.ranks, src.astype(np.int64), dst.astype(np.int64))
            mamba = [g for g, grp in enumerate(layout.groups) if grp.kind == "mamba"]
            if state_of is not None:
                src = np.concatenate([kept[state_of].block_ids[g] for g in mamba])
                dst = np.concatenate([blocks.block_ids[g] for g in mamba])
                copy_blocks(engine.ranks, src.astype(np.int64), dst.astype(np.int64))
            else:
                PagedStateStore(layout, engine.ranks, blocks).reset_ssm()
            again = engine.start_prefill_at(prompt, blocks, 40)
            for end in chunk_ends(40, n, CHUNK):
                again.compute(end)
            return _state(engine, blocks, n)

        assert _equal(resumed("resumed", 40), want)
        # Negative controls: another boundary's state, or none, is not the state at 40.
        assert not _equal(resumed("other-boundary", 20), want)
        assert not _equal(resumed("not-restored", None), want)
    finally:
        colocated.close()
