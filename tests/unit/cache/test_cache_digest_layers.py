"""Digests of a layer part: per (rank, section, group), the definition's bytes of the group's
layers in the part's range only, in the same order; a changed byte changes the digest of the
part holding its layer only; engines of other TP and block sizes agree; mismatches name the
part's layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from shared.cache.digest import SectionDigest, compare_digests, state_digests
from shared.cache.model_views import RankViews
from shared.layout.models import load_model
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.shapes import global_conv_dim, global_ssm_shape
from shared.layout.spec import LayoutError, layer_ranges
from tests.unit.cache.test_cache_digest_definition import _random_cache, write_global_state

ATTENTION = np.array([5, 2, 6])  # out of order, as an allocator hands them out
FIRST_MAMBA_BLOCK = 3
Key = tuple[int, str, int]


def _block_ids(layout: EngineLayout, attention: np.ndarray, first_mamba: int) -> list[np.ndarray]:
    """A request's blocks: `attention` for the FA group, then one block per Mamba group from
    `first_mamba` on (groups share regions: their blocks must differ, as an allocator's do)."""
    mamba = iter(range(first_mamba, first_mamba + len(layout.groups)))
    return [attention if g.kind == "attention" else np.array([next(mamba)]) for g in layout.groups]


def _by_key(digests: list[SectionDigest]) -> dict[Key, bytes]:
    return {(d.rank, d.section, d.group): d.digest for d in digests}


def _oracle(layout: EngineLayout, views: RankViews, tokens: int, layers: range) -> dict[Key, bytes]:
    """The definition for one rank (TP 1), token by token and layer by layer, over the group's
    regions whose layer is in `layers` (no part of the code under test)."""
    out: dict[Key, bytes] = {}
    kernel, slot = layout.token_slots(ATTENTION, np.arange(tokens))
    block_ids = _block_ids(layout, ATTENTION, FIRST_MAMBA_BLOCK)
    for g, group in enumerate(layout.groups):
        regions = [j for j, layer in enumerate(group.layers) if layer in layers]
        if not regions:
            continue
        if group.kind == "attention":
            h = xxhash.xxh3_128()
            for region in regions:
                fa = views.fa[region]
                for kv in (0, 1):
                    for head in range(fa.shape[2]):
                        for k, s in zip(kernel.tolist(), slot.tolist(), strict=True):
                            h.update(fa[k, kv, head, s].contiguous().view(torch.uint8).numpy().tobytes())
            out[(0, "fa", g)] = h.digest()
            continue
        for section, states in (("conv", views.conv), ("ssm", views.ssm)):
            h = xxhash.xxh3_128()
            for region in regions:
                h.update(states[region][int(block_ids[g][0])].contiguous().view(torch.uint8).numpy().tobytes())
            out[(0, section, g)] = h.digest()
    return out


@pytest.fixture
def tiny() -> tuple[EngineLayout, RankViews]:
    layout = build_engine_layout(load_model("tiny-mamba2"), 1)  # s a s s a s: FA (1, 4), Mamba (0, 3), (2, 5)
    return layout, _random_cache(layout, 7, seed=4)


def test_each_part_digests_its_layers_as_the_definition(tiny: tuple[EngineLayout, RankViews]) -> None:
    layout, views = tiny
    ids = _block_ids(layout, ATTENTION, FIRST_MAMBA_BLOCK)
    n = layout.block_size + 9
    whole = state_digests(layout, [views], ids, n)
    assert state_digests(layout, [views], ids, n, layers=range(6)) == whole
    assert _by_key(whole) == _oracle(layout, views, n, range(6))
    for parts in (2, 3, 6):
        for layers in layer_ranges(6, parts):
            got = state_digests(layout, [views], ids, n, layers=layers)
            assert _by_key(got) == _oracle(layout, views, n, layers), layers
            assert len(got) == len(_by_key(got))  # one digest per key
    only_attention = state_digests(layout, [views], ids, n, layers=range(1, 2))
    assert [(d.section, d.group) for d in only_attention] == [("fa", 2)]
    # The key order stays the whole set's: rank, then group, sections in order.
    part = state_digests(layout, [views], ids, n, layers=range(2, 5))
    assert [(d.section, d.group) for d in part] == [("conv", 0), ("ssm", 0), ("conv", 1), ("ssm", 1), ("fa", 2)]


def test_a_changed_byte_changes_only_the_part_holding_its_layer(tiny: tuple[EngineLayout, RankViews]) -> None:
    layout, views = tiny
    ids = _block_ids(layout, ATTENTION, FIRST_MAMBA_BLOCK)
    n = 2 * layout.block_size
    parts = layer_ranges(6, 3)  # [0, 2) [2, 4) [4, 6)

    def digests() -> list[dict[Key, bytes]]:
        return [_by_key(state_digests(layout, [views], ids, n, layers=layers)) for layers in parts]

    before = digests()
    fa_group, mamba_group = layout.attention_group_ids[0], layout.mamba_group_ids[0]
    kernel, slot = (int(a[0]) for a in layout.token_slots(ATTENTION, [n - 1]))
    block = int(ids[mamba_group][0])
    flips = [
        (4, "fa", fa_group, views.fa[layout.region_of("attention", 4)][kernel, 1, 0, slot]),  # V of layer 4
        (3, "conv", mamba_group, views.conv[layout.region_of("mamba", 3)][block, 0]),
        (0, "ssm", mamba_group, views.ssm[layout.region_of("mamba", 0)][block, 0, 0]),
    ]
    for layer, section, group, element in flips:
        raw = element.view(torch.uint8).reshape(-1)
        raw[0] ^= 0x01
        after = digests()
        for layers, old, new in zip(parts, before, after, strict=True):
            changed = {key for key in old if old[key] != new[key]}
            assert changed == ({(0, section, group)} if layer in layers else set()), (layer, layers)
        raw[0] ^= 0x01
    assert digests() == before


@pytest.mark.parametrize(
    ("model", "source", "local"),
    [("tiny-gdn", (2, 16), (1, 32)), ("tiny-mamba2", (1, None), (2, None)), ("tiny-gdn", (1, 16), (4, 16))],
    ids=["P2-k16-D1-k32", "P1-D2", "P1-D4-replicated"],
)
def test_decode_finds_a_parts_digests_in_its_own_layout(
    model: str, source: tuple[int, int | None], local: tuple[int, int | None]
) -> None:
    """The same global state written into both engines' shards: every part's digests agree."""
    spec = load_model(model)
    src = build_engine_layout(spec, source[0], kernel_block_size=source[1])
    dst = build_engine_layout(spec, local[0], kernel_block_size=local[1])
    n = 37
    gen = torch.Generator().manual_seed(5)
    regions = max(len(g.layers) for g in src.groups)
    kv = torch.randn(regions, 2, spec.attention.num_kv_heads, n, src.shapes.head_dim, generator=gen)
    conv = torch.randn(len(src.groups), regions, global_conv_dim(spec), src.shapes.conv_rows, generator=gen)
    ssm = torch.randn(len(src.groups), regions, *global_ssm_shape(spec), generator=gen)
    src_ids, dst_ids = np.array([3, 0, 5, 1]), np.array([2, 6, 4, 0])
    src_views = [_random_cache(src, 10, seed=10 + r) for r in range(src.tp)]
    dst_views = [_random_cache(dst, 10, seed=20 + r) for r in range(dst.tp)]
    prefill_ids, decode_ids = _block_ids(src, src_ids, 7), _block_ids(dst, dst_ids, 7)
    write_global_state(src, src_views, src_ids, kv, (prefill_ids, conv, ssm))
    write_global_state(dst, dst_views, dst_ids, kv, (decode_ids, conv, ssm))
    for layers in (*layer_ranges(6, 3), range(1, 5), range(5, 6)):
        prefill = state_digests(src, src_views, prefill_ids, n, layers=layers)
        decode = state_digests(dst, dst_views, decode_ids, n, source=src, layers=layers)
        assert prefill == decode and {d.rank for d in prefill} == set(range(src.tp)), layers
        assert compare_digests(dst, prefill, decode, layers) == []
    # Negative control: one byte of layer 4's K (region 1 of the FA group) in decode rank 0.
    kernel_block, last_slot = (int(a[0]) for a in dst.token_slots(dst_ids, np.array([n - 1])))
    dst_views[0].fa[1][kernel_block, 0, 0, last_slot].view(torch.uint8)[0] ^= 1
    for layers, changed in ((range(0, 4), False), (range(4, 6), True)):
        prefill = state_digests(src, src_views, prefill_ids, n, layers=layers)
        decode = state_digests(dst, dst_views, decode_ids, n, source=src, layers=layers)
        assert (prefill != decode) == changed, layers


def test_mismatches_name_the_parts_layers(tiny: tuple[EngineLayout, RankViews]) -> None:
    layout, views = tiny
    ids = _block_ids(layout, ATTENTION, FIRST_MAMBA_BLOCK)
    layers = range(2, 6)
    expected = state_digests(layout, [views], ids, 20, layers=layers)
    views.conv[1][int(ids[1][0]), 0].view(torch.uint8)[0] ^= 0x01  # layer 5: region 1 of Mamba group 1
    got = state_digests(layout, [views], ids, 20, layers=layers)
    bad = compare_digests(layout, expected, got, layers)
    assert [(m.section, m.group, m.layers) for m in bad] == [("conv", 1, (2, 5))]
    missing = compare_digests(layout, expected, [d for d in got if d.section != "fa"], layers)
    assert [(m.section, m.group, m.layers) for m in missing if m.section == "fa"] == [("fa", 2, (4,))]
    # The whole request's: every layer of the group.
    assert [m.layers for m in compare_digests(layout, expected, got)] == [(2, 5)]


def test_layer_ranges_are_validated(tiny: tuple[EngineLayout, RankViews]) -> None:
    layout, views = tiny
    ids = _block_ids(layout, ATTENTION, FIRST_MAMBA_BLOCK)
    for bad in (range(-1, 3), range(0, 7), range(2, 2), range(0, 6, 2)):
        with pytest.raises(LayoutError, match="layers"):
            state_digests(layout, [views], ids, 10, layers=bad)
        with pytest.raises(LayoutError, match="layers"):
            compare_digests(layout, [], [], bad)
