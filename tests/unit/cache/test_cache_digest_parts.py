"""Digests of one part of a pipelined transfer: section fa of tokens [tokens_from, num_tokens)
only, and only the sections asked for."""

from __future__ import annotations

import numpy as np
import torch

from shared.cache.digest import state_digests
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout


def test_a_part_digests_its_tokens_only() -> None:
    layout = build_engine_layout(load_model("tiny-mamba2"), 1)
    cache = RankCache(layout.num_regions, 7, layout.page_bytes, huge_pages=False)
    for region in cache.regions:
        region.copy_(torch.randint(0, 256, (region.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)))
    views = [RankViews(layout, cache)]
    block_ids = [np.array([3]) if g.kind == "mamba" else np.array([5, 2, 6]) for g in layout.groups]
    start, end = layout.block_size, 2 * layout.block_size + 5

    def part() -> dict[tuple[str, int], bytes]:
        digests = state_digests(layout, views, block_ids, end, tokens_from=start, sections=("fa",))
        return {(d.section, d.group): d.digest for d in digests}

    before = part()
    assert {section for section, _ in before} == {"fa"}
    assert set(before.values()) != {d.digest for d in state_digests(layout, views, block_ids, end) if d.section == "fa"}
    fa = views[0].fa[0]
    for token, inside in ((start - 1, False), (start, True), (end - 1, True), (end, False)):
        kernel, slot = layout.token_slots(block_ids[layout.attention_group_ids[0]], [token])
        raw = fa[int(kernel[0]), 0, 0, int(slot[0])].view(torch.uint8)
        raw[0] ^= 0x01
        assert (part() != before) == inside, token
        raw[0] ^= 0x01
    assert part() == before
    whole = state_digests(layout, views, block_ids, end, sections=("conv", "ssm"))
    assert {d.section for d in whole} == {"conv", "ssm"}
