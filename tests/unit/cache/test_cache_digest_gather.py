"""The digests' K/V gather equals the definition: token by token, [token, K|V, head, head_dim]."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.cache.digest import _kernel_blocks, _token_major
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout


@pytest.mark.parametrize(("model", "tp", "kernel_block_size"), [("tiny-mamba2", 1, None), ("tiny-gdn", 2, 16)])
def test_block_gather_equals_token_by_token_indexing(model: str, tp: int, kernel_block_size: int | None) -> None:
    layout = build_engine_layout(load_model(model), tp, kernel_block_size=kernel_block_size)
    cache = RankCache(layout.num_regions, 7, layout.page_bytes, huge_pages=False)
    for region in cache.regions:
        region.copy_(torch.randint(0, 256, (region.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    fa = RankViews(layout, cache).fa[0]
    block_ids = np.array([5, 2, 6])  # out of order, as an allocator hands them out
    heads = slice(0, fa.shape[2]) if fa.shape[2] == 1 else slice(1, fa.shape[2])
    for num_tokens in (1, layout.kernel_block_size, layout.kernel_block_size + 1, 2 * layout.block_size + 3):
        kernel, slot = (torch.from_numpy(a) for a in layout.token_slots(block_ids, np.arange(num_tokens)))
        expected = fa[kernel, :, heads, slot, :]  # the definition, one token at a time
        got = _token_major(fa, _kernel_blocks(layout, block_ids, num_tokens), heads, num_tokens)
        assert got.shape == expected.shape and torch.equal(_raw(got), _raw(expected)), num_tokens
    # Negative control: another block order gathers other bytes.
    other = _token_major(fa, _kernel_blocks(layout, block_ids[::-1].copy(), num_tokens), heads, num_tokens)
    assert not torch.equal(_raw(other), _raw(expected))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes (random bytes seen as floats hold NaNs, which never compare equal)."""
    return t.contiguous().view(torch.uint8)
