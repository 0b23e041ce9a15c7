"""The digests hash the bytes their definition names, token by token, in place in the cache:
K/V as, layer by layer, K then V, head by head, the head's `[token, head_dim]` rows; and two
engines of different TP and block sizes holding the same state get the same digests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from shared.cache.digest import state_digests
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.layout.models import load_model
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.shapes import conv_channel_index, kv_head_index, ssm_row_index


def _random_cache(layout: EngineLayout, num_blocks: int, seed: int) -> RankViews:
    cache = RankCache(layout.num_regions, num_blocks, layout.page_bytes, huge_pages=False)
    for region in cache.regions:
        region.copy_(torch.randint(0, 256, (region.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return RankViews(layout, cache)


def write_global_state(
    layout: EngineLayout,
    views: list[RankViews],
    ids: np.ndarray,
    kv: torch.Tensor,
    mamba: tuple[list[np.ndarray], torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Shard one global state into every rank of `layout`, as its engine would hold it: K/V
    `kv[region, K|V, head, token]` of tokens 0.. into the attention blocks `ids`; with `mamba`
    (block ids per group, conv and SSM `[group, region, ...]`), the conv and SSM state too."""
    spec = layout.spec
    kernel, slot = (torch.from_numpy(a) for a in layout.token_slots(ids, np.arange(kv.shape[3])))
    for r, view in enumerate(views):
        for region, fa in enumerate(view.fa):
            for pos, head in enumerate(kv_head_index(spec, layout.tp, r).tolist()):
                fa[kernel, :, pos, slot, :] = kv[region, :, head].to(fa.dtype).permute(1, 0, 2)
        if mamba is None:
            continue
        blocks, conv, ssm = mamba
        chans = torch.from_numpy(conv_channel_index(spec, layout.tp, r))
        rows = torch.from_numpy(ssm_row_index(spec, layout.tp, r))
        for g in layout.mamba_group_ids:
            block = int(blocks[g][0])
            for region in range(len(layout.groups[g].layers)):
                view.conv[region][block] = conv[g, region][chans].to(view.conv[region].dtype)
                view.ssm[region][block] = ssm[g, region][rows].to(view.ssm[region].dtype)


def _block_ids(layout: EngineLayout, attention: np.ndarray, mamba: int) -> list[np.ndarray]:
    return [attention if g.kind == "attention" else np.array([mamba]) for g in layout.groups]


def _oracle_fa(layout: EngineLayout, views: RankViews, block_ids: np.ndarray, tokens: range, group: int) -> bytes:
    """The definition, one token at a time (no part of the code under test)."""
    kernel, slot = layout.token_slots(block_ids, np.array(tokens))
    h = xxhash.xxh3_128()
    for region in range(len(layout.groups[group].layers)):
        fa = views.fa[region]
        for kv in (0, 1):
            for head in range(fa.shape[2]):
                for k, s in zip(kernel.tolist(), slot.tolist()):
                    h.update(fa[k, kv, head, s].contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


@pytest.mark.parametrize(("model", "kernel_block_size"), [("tiny-mamba2", None), ("tiny-gdn", 16)])
def test_the_fa_digest_hashes_the_definition_token_by_token(model: str, kernel_block_size: int | None) -> None:
    layout = build_engine_layout(load_model(model), 1, kernel_block_size=kernel_block_size)
    views = _random_cache(layout, 7, seed=1)
    attention = np.array([5, 2, 6])  # out of order, as an allocator hands them out
    group = next(g for g, grp in enumerate(layout.groups) if grp.kind == "attention")
    ids = _block_ids(layout, attention, 3)
    size = layout.kernel_block_size
    for tokens in (range(1), range(size), range(size + 1), range(2 * layout.block_size + 3), range(size - 1, size + 2)):
        got = state_digests(layout, [views], ids, tokens.stop, tokens_from=tokens.start, sections=("fa",))
        assert [d.section for d in got] == ["fa"]
        assert got[0].digest == _oracle_fa(layout, views, attention, tokens, group), tokens
    # Negative controls: another block order, or one token fewer, hashes other bytes.
    n = 2 * layout.block_size + 3
    expected = _oracle_fa(layout, views, attention, range(n), group)
    reordered = state_digests(layout, [views], _block_ids(layout, attention[::-1].copy(), 3), n, sections=("fa",))
    shorter = state_digests(layout, [views], ids, n - 1, sections=("fa",))
    assert reordered[0].digest != expected and shorter[0].digest != expected


def test_a_token_range_digest_is_the_definition_over_that_range_only() -> None:
    layout = build_engine_layout(load_model("tiny-gdn"), 1, kernel_block_size=16)
    views = _random_cache(layout, 7, seed=2)
    ids = _block_ids(layout, np.array([4, 1, 6]), 0)
    whole = state_digests(layout, [views], ids, 40, sections=("fa",))
    first, rest = (
        state_digests(layout, [views], ids, stop, tokens_from=start, sections=("fa",)) for start, stop in ((0, 20), (20, 40))
    )
    assert first[0].digest != whole[0].digest != rest[0].digest  # parts are digests of their own tokens
    kernel_block, slot = (int(a[0]) for a in layout.token_slots(np.array([4, 1, 6]), np.array([5])))
    views.fa[0][kernel_block, 1, 0, slot].view(torch.uint8)[0] ^= 1  # V of token 5
    flipped = [
        state_digests(layout, [views], ids, stop, tokens_from=start, sections=("fa",)) for start, stop in ((0, 20), (20, 40))
    ]
    assert flipped[0][0].digest != first[0].digest and flipped[1][0].digest == rest[0].digest  # token 5 is in the first part only


@pytest.mark.parametrize(
    ("model", "source", "local"),
    [("tiny-gdn", (2, 16), (1, 32)), ("tiny-mamba2", (1, None), (2, None)), ("tiny-gdn", (1, 16), (4, 16))],
    ids=["P2-k16-D1-k32", "P1-D2", "P1-D4-replicated"],
)
def test_engines_of_other_tp_and_block_sizes_holding_the_same_state_get_the_same_digests(
    model: str, source: tuple[int, int | None], local: tuple[int, int | None]
) -> None:
    spec = load_model(model)
    src = build_engine_layout(spec, source[0], kernel_block_size=source[1])
    dst = build_engine_layout(spec, local[0], kernel_block_size=local[1])
    n = 37
    kv = torch.randn(
        max(len(g.layers) for g in src.groups),
        2,
        spec.attention.num_kv_heads,
        n,
        src.shapes.head_dim,
        generator=torch.Generator().manual_seed(3),
    )
    src_ids, dst_ids = np.array([3, 0, 5, 1]), np.array([2, 6, 4, 0])
    src_views = [_random_cache(src, 8, seed=10 + r) for r in range(src.tp)]
    dst_views = [_random_cache(dst, 8, seed=20 + r) for r in range(dst.tp)]
    write_global_state(src, src_views, src_ids, kv)
    write_global_state(dst, dst_views, dst_ids, kv)
    prefill = state_digests(src, src_views, _block_ids(src, src_ids, 7), n, sections=("fa",))
    decode = state_digests(dst, dst_views, _block_ids(dst, dst_ids, 7), n, source=src, sections=("fa",))
    assert [d.digest for d in prefill] == [d.digest for d in decode] and len(prefill) == src.tp
    # Negative control: one byte of the last token's K in decode rank 0 differs.
    kernel_block, last_slot = (int(a[0]) for a in dst.token_slots(dst_ids, np.array([n - 1])))
    dst_views[0].fa[0][kernel_block, 0, 0, last_slot].view(torch.uint8)[0] ^= 1
    changed = state_digests(dst, dst_views, _block_ids(dst, dst_ids, 7), n, source=src, sections=("fa",))
    assert [d.digest for d in changed] != [d.digest for d in prefill]
