"""K/V the digests cannot hash where it lies (a device cache, or a view not laid out contiguously)
is copied to the host, just the request's kernel blocks, and hashed there: the same digests as
the same values hashed in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.cache.digest import state_digests
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


def _relaid(fa: torch.Tensor, device: str) -> torch.Tensor:
    """`fa`'s values on `device`, K/V-major in memory: not contiguous in `fa`'s index order."""
    moved = fa.permute(1, 0, 2, 3, 4).contiguous().permute(1, 0, 2, 3, 4).to(device)
    assert not moved.is_contiguous()
    return moved


@pytest.mark.parametrize("device", DEVICES)
def test_kv_copied_to_the_host_has_the_digests_of_kv_hashed_in_place(device: str) -> None:
    layout = build_engine_layout(load_model("tiny-gdn"), 1, kernel_block_size=16)
    cache = RankCache(layout.num_regions, 7, layout.page_bytes, huge_pages=False)
    for region in cache.regions:
        region.copy_(torch.randint(0, 256, (region.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))
    in_place = RankViews(layout, cache)
    copied = RankViews(layout, cache)
    copied.fa = [_relaid(fa, device) for fa in in_place.fa]
    ids = [np.array([5, 2, 6]) if g.kind == "attention" else np.array([0]) for g in layout.groups]
    n = 2 * layout.block_size + 3
    for tokens_from in (0, 5, layout.block_size + 17):  # parts starting inside a kernel block too
        want = state_digests(layout, [in_place], ids, n, tokens_from=tokens_from, sections=("fa",))
        got = state_digests(layout, [copied], ids, n, tokens_from=tokens_from, sections=("fa",))
        assert got == want, tokens_from
    # Negative control: a byte changed in the copied cache only (V of the last token) changes its digest.
    kernel, slot = (int(a[0]) for a in layout.token_slots(ids[layout.attention_group_ids[0]], [n - 1]))
    intact = state_digests(layout, [in_place], ids, n, sections=("fa",))
    copied.fa[0][kernel, 1, 0, slot].view(torch.uint8)[0] ^= 1
    assert state_digests(layout, [copied], ids, n, sections=("fa",)) != intact
