"""Read lists and per-request indices: pairing, equality with the dual view in the homogeneous
case, contiguous ids for contiguous blocks, per-head descriptors for different kernel sizes."""

from __future__ import annotations

import numpy as np
import pytest

from shared.layout.descriptors import descriptor_ids, dual_view
from shared.layout.page import build_engine_layout
from shared.layout.plan import TransferPlan, build_plan
from shared.layout.presets import get_preset
from shared.layout.read_lists import ReadLists, build_read_lists, read_indices
from shared.layout.spec import LayoutError

pytestmark = pytest.mark.timeout(60)


def lists_for(plan: TransferPlan, d: int, p: int, n_local: int = 6, n_remote: int = 7) -> ReadLists:
    return build_read_lists(
        plan,
        d,
        p,
        local_bases=[(j + 1) << 36 for j in range(plan.decode.num_regions)],
        remote_bases=[(j + 1) << 40 for j in range(plan.prefill.num_regions)],
        local_num_blocks=n_local,
        remote_num_blocks=n_remote,
    )


def blocks(plan: TransferPlan, fa: list[int], mamba: int) -> list[np.ndarray]:
    return [np.array(fa) if g.kind == "attention" else np.array([mamba]) for g in plan.decode.groups]


def test_homogeneous_lists_are_the_dual_view() -> None:
    spec = get_preset("tiny-mamba2")
    lay = build_engine_layout(spec, 2, kernel_block_size=16)
    plan = build_plan(lay, lay)
    rl = lists_for(plan, 1, 1, n_local=6, n_remote=6)
    assert np.array_equal(rl.local, dual_view(lay, [(j + 1) << 36 for j in range(2)], 6).descs)
    ids = blocks(plan, [4, 1], 3)
    li, ri = read_indices(rl, ids, ids, num_tokens=2 * lay.block_size)
    assert np.array_equal(li, ri)
    assert np.array_equal(li, descriptor_ids(lay, 6, ids))


def test_pairs_have_equal_lengths_and_cover_tokens() -> None:
    spec = get_preset("tiny-gdn")
    plan = build_plan(build_engine_layout(spec, 1), build_engine_layout(spec, 4))  # 48 vs 32 token blocks
    assert plan.fa_unit_tokens == 16
    rl = lists_for(plan, 2, 0)
    assert rl.fa_pieces == 2  # one head per decode rank: one piece per K or V
    li, ri = read_indices(rl, blocks(plan, [5, 0], 3), blocks(plan, [2, 6], 4), num_tokens=40)
    assert len(li) == len(ri)
    assert np.array_equal(rl.local[li, 1], rl.remote[ri, 1])
    units = 3  # ceil(40 / 16)
    mamba_pieces = 4 * 2  # x.. q, k, v, SSM per region, 2 regions per group
    assert len(li) == 2 * 2 * units + 2 * mamba_pieces


def test_different_kernel_sizes_use_one_descriptor_per_head() -> None:
    spec = get_preset("tiny-mamba1")  # 2 KV heads: both on one rank at TP 1
    plan = build_plan(build_engine_layout(spec, 1, kernel_block_size=16), build_engine_layout(spec, 1, kernel_block_size=32))
    rl = lists_for(plan, 0, 0)
    assert rl.fa_pieces == 2 * 2  # K and V, per head
    assert np.all(rl.local[: rl.local_geometry.fa_part, 1] == 16 * 16 * 4)
    same = build_plan(build_engine_layout(spec, 1, kernel_block_size=16), build_engine_layout(spec, 1, kernel_block_size=16))
    assert lists_for(same, 0, 0).fa_pieces == 2


def test_contiguous_blocks_give_contiguous_id_runs() -> None:
    spec = get_preset("tiny-mamba2")
    plan = build_plan(build_engine_layout(spec, 2, kernel_block_size=8), build_engine_layout(spec, 4, kernel_block_size=8))
    rl = lists_for(plan, 1, 0, n_local=10, n_remote=10)
    fa_local, fa_remote = [2, 3, 4], [5, 6, 7]
    tokens = 3 * plan.decode.block_size  # 48 tokens: 6 kernel blocks
    li, ri = read_indices(rl, blocks(plan, fa_local, 0), blocks(plan, fa_remote, 1), num_tokens=tokens)
    units = tokens // 8  # one unit per kernel block (equal kernel sizes)
    for idx, geometry in ((li, rl.local_geometry), (ri, rl.remote_geometry)):
        fa = idx[idx < geometry.fa_part]
        assert len(fa) == 2 * 2 * units  # regions x (K, V) x kernel blocks
        assert np.all(np.diff(fa.reshape(-1, units), axis=1) == 1)
    # Each run starts at the first kernel block of the request's first logical block.
    fa_local_ids = li[li < rl.local_geometry.fa_part]
    assert rl.local[fa_local_ids[0], 0] == (1 << 36) + 2 * plan.decode.physical_per_logical * plan.decode.kernel_page_bytes


def test_not_an_fa_source_moves_mamba_only() -> None:
    spec = get_preset("tiny-mamba2")  # 2 KV heads, replicated at TP 4
    plan = build_plan(build_engine_layout(spec, 4), build_engine_layout(spec, 1))
    rank = plan.ranks[0]
    assert rank.fa_sources == (0, 2) and rank.mamba_sources == (0, 1, 2, 3)
    rl = lists_for(plan, 0, 1)
    assert rl.fa_pieces == 0 and rl.local_geometry.fa_part == 0
    li, ri = read_indices(rl, blocks(plan, [0], 1), blocks(plan, [0], 1), num_tokens=10)
    assert len(li) == 2 * 2 * 4  # two Mamba groups x 2 regions x (x, B, C, SSM)


def test_errors() -> None:
    spec = get_preset("tiny-mamba2")
    plan = build_plan(build_engine_layout(spec, 2), build_engine_layout(spec, 2))
    rl = lists_for(plan, 0, 0)
    with pytest.raises(LayoutError, match="3 groups"):
        read_indices(rl, [np.array([0])], [np.array([0])], 1)
    with pytest.raises(LayoutError, match="FA units"):
        read_indices(rl, blocks(plan, [0], 1), blocks(plan, [0], 1), num_tokens=plan.decode.block_size + 1)
    bad = blocks(plan, [0], 1)
    bad[0] = np.array([1, 2])
    with pytest.raises(LayoutError, match="exactly 1 block"):
        read_indices(rl, bad, blocks(plan, [0], 1), 1)
    with pytest.raises(LayoutError, match="outside"):
        read_indices(rl, blocks(plan, [6], 1), blocks(plan, [0], 1), 1)
    with pytest.raises(LayoutError, match="region base"):
        build_read_lists(plan, 0, 0, local_bases=[0], remote_bases=[0, 1], local_num_blocks=1, remote_num_blocks=1)
    with pytest.raises(LayoutError, match="reads nothing"):
        lists_for(plan, 0, 1)
    assert [len(x) for x in read_indices(rl, blocks(plan, [], 1), blocks(plan, [], 1), 0)] == [16, 16]
