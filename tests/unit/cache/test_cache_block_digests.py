"""The prefix cache's per-block FA digests in one pass (`block_digests`) equal one
`state_digests` call per block, and still see a single flipped byte of any one block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.cache.digest import block_digests, state_digests
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout


@pytest.mark.parametrize("tp,kernel", [(1, None), (2, 8)])
def test_one_pass_equals_one_call_per_block(tp: int, kernel: int | None) -> None:
    layout = build_engine_layout(load_model("tiny-mamba2"), tp, kernel_block_size=kernel)
    caches = [RankCache(layout.num_regions, 9, layout.page_bytes, huge_pages=False) for _ in range(tp)]
    for r, cache in enumerate(caches):
        for region in cache.regions:
            region.copy_(torch.randint(0, 256, (region.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(r)))
    views = [RankViews(layout, cache) for cache in caches]
    block_ids = [np.array([3]) if g.kind == "mamba" else np.array([5, 2, 6, 8]) for g in layout.groups]
    indices = [0, 2, 3]

    def per_block() -> list[tuple[object, ...]]:
        out = []
        for i in indices:
            ids = [b[i : i + 1] if g.kind == "attention" else b for b, g in zip(block_ids, layout.groups)]
            out.append(tuple(state_digests(layout, views, ids, layout.block_size, sections=("fa",))))
        return out

    want = per_block()
    assert block_digests(layout, views, block_ids, indices) == want
    assert len({d for block in want for d in block}) == len(indices) * len(want[0])  # blocks differ
    # Negative control: a byte of block 2 (index 1 of `indices`) flipped changes its digests only.
    group = layout.attention_group_ids[0]
    kernel_id, slot = layout.token_slots(block_ids[group], [2 * layout.block_size + 1])
    raw = views[tp - 1].fa[0][int(kernel_id[0]), 1, 0, int(slot[0])].view(torch.uint8)
    raw[0] ^= 0x01
    got = block_digests(layout, views, block_ids, indices)
    assert got == per_block() and got[0] == want[0] and got[2] == want[2] and got[1] != want[1]
