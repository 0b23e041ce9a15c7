"""Read lists and per-request indices: pairing, the dual view reordered block-major in the
homogeneous case, contiguous ids for contiguous blocks, mergeable runs (as NIXL merges them) on
equal TP and kernel sizes, per-head descriptors for different kernel sizes."""

from __future__ import annotations

import numpy as np
import pytest

from shared.layout.page import build_engine_layout
from shared.layout.plan import TransferPlan, build_plan
from shared.layout.presets import get_preset
from shared.layout.read_lists import ReadLists, build_read_lists, read_indices
from shared.layout.spec import LayoutError
from tests.unit.layout.dual_view import descriptor_ids, dual_view

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


def wire_descriptors(rl: ReadLists, li: np.ndarray, ri: np.ndarray) -> int:
    """How many descriptors NIXL's make_prepped_xfer sends: a run of consecutive indices (on both
    sides) over adjacent equal-size descriptors (on both sides) is merged into one."""
    local, remote = rl.local[li], rl.remote[ri]
    merges = (
        (np.diff(li) == 1)
        & (np.diff(ri) == 1)
        & (local[1:, 0] == local[:-1, 0] + local[:-1, 1])
        & (remote[1:, 0] == remote[:-1, 0] + remote[:-1, 1])
        & (local[1:, 1] == local[:-1, 1])
        & (remote[1:, 1] == remote[:-1, 1])
    )
    return int(len(li) - merges.sum())


def test_homogeneous_lists_are_the_dual_view_block_major() -> None:
    spec = get_preset("tiny-mamba2")
    lay = build_engine_layout(spec, 2, kernel_block_size=16)
    plan = build_plan(lay, lay)
    rl = lists_for(plan, 1, 1, n_local=6, n_remote=6)
    view = dual_view(lay, [(j + 1) << 36 for j in range(2)], 6)
    regions, pieces = lay.num_regions, view.mamba_pieces
    # Same descriptors as vLLM's region-major view, each region's part transposed to block-major.
    fa_order = np.arange(view.num_fa_descs).reshape(regions, 2, view.num_kernel_blocks).transpose(0, 2, 1)
    mamba_order = view.num_fa_descs + np.arange(regions * pieces * 6).reshape(regions, pieces, 6).transpose(0, 2, 1)
    assert np.array_equal(rl.local, view.descs[np.concatenate([fa_order.reshape(-1), mamba_order.reshape(-1)])])
    assert rl.local_geometry.fa_part == view.num_fa_descs
    ids = blocks(plan, [4, 1], 3)
    li, ri = read_indices(rl, ids, ids, num_tokens=2 * lay.block_size)
    assert np.array_equal(li, ri)
    # The request selects exactly the reference view's descriptors, group by group and region by
    # region, in block-major order.
    ref = view.descs[descriptor_ids(lay, 6, ids)]
    got = rl.local[li]
    at = 0
    for group in lay.groups:
        for _ in group.layers:
            if group.kind == "attention":
                n = 2 * 2 * lay.physical_per_logical  # (K, V) x kernel blocks of 2 logical blocks
                expected = ref[at : at + n].reshape(2, -1, 2).transpose(1, 0, 2).reshape(-1, 2)
            else:
                n = pieces
                expected = ref[at : at + n]
            assert np.array_equal(got[at : at + n], expected)
            at += n
    assert at == len(li)


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
        assert len(fa) == 2 * 2 * units  # regions x kernel blocks x (K, V)
        assert np.all(np.diff(fa.reshape(2, -1), axis=1) == 1)  # one run per region
    # Each run starts with K of the first kernel block of the request's first logical block,
    # then V of that kernel block.
    fa_local_ids = li[li < rl.local_geometry.fa_part]
    first = (1 << 36) + 2 * plan.decode.physical_per_logical * plan.decode.kernel_page_bytes
    assert rl.local[fa_local_ids[0], 0] == first
    assert rl.local[fa_local_ids[1], 0] == first + plan.decode.kernel_page_bytes // 2
    # 2 KV heads: one whole head per rank on both sides, so each FA run is adjacent bytes too.
    is_fa = li < rl.local_geometry.fa_part
    assert wire_descriptors(rl, li[is_fa], ri[is_fa]) == 2


@pytest.mark.parametrize(("name", "tp"), [("tiny-mamba2", 2), ("tiny-gdn", 2), ("nemotron-3-nano-30b-a3b", 2)])
def test_contiguous_blocks_on_equal_tp_merge_to_one_descriptor_per_fa_region(name: str, tp: int) -> None:
    spec = get_preset(name)
    lay = build_engine_layout(spec, tp, kernel_block_size=16)
    plan = build_plan(lay, lay)
    rl = lists_for(plan, tp - 1, tp - 1, n_local=10, n_remote=12)
    tokens = 3 * lay.block_size - 5
    li, ri = read_indices(rl, blocks(plan, [2, 3, 4], 7), blocks(plan, [6, 7, 8], 1), num_tokens=tokens)
    kernel_blocks = -(-tokens // 16)
    fa_regions = sum(len(g.layers) for g in lay.groups if g.kind == "attention")
    for idx, descs, geometry in ((li, rl.local, rl.local_geometry), (ri, rl.remote, rl.remote_geometry)):
        fa = idx[idx < geometry.fa_part].reshape(fa_regions, -1)
        assert fa.shape[1] == 2 * kernel_blocks
        for run in fa:  # per region: consecutive ids over adjacent, equal-size descriptors
            assert np.all(np.diff(run) == 1)
            d = descs[run]
            assert np.all(d[1:, 0] == d[:-1, 0] + d[:-1, 1]) and np.all(d[:, 1] == lay.kernel_page_bytes // 2)
        # Mamba: per region, the pieces of its one page are consecutive ids over adjacent bytes
        # that cover the real state exactly (whole sections on equal TP).
        mamba = idx[idx >= geometry.fa_part].reshape(-1, rl.mamba_pieces)
        for page in mamba:
            assert np.all(np.diff(page) == 1)
            d = descs[page]
            assert np.all(d[1:, 0] == d[:-1, 0] + d[:-1, 1]) and int(d[:, 1].sum()) == lay.mamba_bytes
    # As NIXL merges them: one wire descriptor per FA region; a Mamba page merges its equal-size
    # neighbours only.
    is_fa = li < rl.local_geometry.fa_part
    assert wire_descriptors(rl, li[is_fa], ri[is_fa]) == fa_regions
    mamba_pages = len(li[~is_fa]) // rl.mamba_pieces
    assert mamba_pages <= wire_descriptors(rl, li[~is_fa], ri[~is_fa]) <= len(li[~is_fa])
    # Negative control: decode TP 2 reads half of prefill TP 1's KV heads: consecutive ids, but
    # every K or V piece is half of a half on the prefill side, so nothing merges.
    split = build_plan(build_engine_layout(spec, 1, kernel_block_size=16), build_engine_layout(spec, 2, kernel_block_size=16))
    rl = lists_for(split, 0, 0, n_local=10, n_remote=12)
    li, ri = read_indices(rl, blocks(split, [2, 3, 4], 7), blocks(split, [6, 7, 8], 1), num_tokens=tokens)
    is_fa = li < rl.local_geometry.fa_part
    assert np.all(np.diff(li[is_fa].reshape(fa_regions, -1), axis=1) == 1)
    assert wire_descriptors(rl, li[is_fa], ri[is_fa]) == int(is_fa.sum())


def test_not_an_fa_source_moves_mamba_only() -> None:
    spec = get_preset("tiny-mamba2")  # 2 KV heads, replicated at TP 4
    plan = build_plan(build_engine_layout(spec, 4), build_engine_layout(spec, 1))
    rank = plan.ranks[0]
    assert rank.fa_sources == (0, 2) and rank.mamba_sources == (0, 1, 2, 3)
    rl = lists_for(plan, 0, 1)
    assert rl.fa_pieces == 0 and rl.local_geometry.fa_part == 0
    li, _ri = read_indices(rl, blocks(plan, [0], 1), blocks(plan, [0], 1), num_tokens=10)
    assert len(li) == 2 * 2 * 4  # two Mamba groups x 2 regions x (x, B, C, SSM)
    assert np.array_equal(rl.mamba_piece_of(li), np.tile(np.arange(4), 4))


def test_mamba_piece_of_names_each_piece() -> None:
    spec = get_preset("tiny-gdn")
    plan = build_plan(build_engine_layout(spec, 1), build_engine_layout(spec, 4))
    rl = lists_for(plan, 2, 0)
    read = plan.ranks[2].read_from(0)
    li, _ = read_indices(rl, blocks(plan, [5, 0], 3), blocks(plan, [2, 6], 4), num_tokens=40)
    mamba = li[li >= rl.local_geometry.fa_part]
    offsets = np.array([m.local_offset for m in read.mamba_reads])
    sizes = np.array([m.size for m in read.mamba_reads])
    piece = rl.mamba_piece_of(mamba)
    # Each id's descriptor is the piece it is named: its offset in the page and its size.
    page_offset = (rl.local[mamba, 0] - (1 << 36)) % plan.decode.page_bytes
    assert np.array_equal(page_offset, offsets[piece]) and np.array_equal(rl.local[mamba, 1], sizes[piece])


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


@pytest.mark.parametrize("num_blocks", [6, 4200])  # 4200: a request of > 4096 FA units, the strided path
def test_ids_select_the_reference_descriptors_at_any_size_and_into_given_buffers(num_blocks: int) -> None:
    spec = get_preset("tiny-mamba2")
    lay = build_engine_layout(spec, 1, kernel_block_size=16)
    plan = build_plan(lay, lay)
    rl = lists_for(plan, 0, 0, n_local=num_blocks, n_remote=num_blocks)
    view = dual_view(lay, [(j + 1) << 36 for j in range(lay.num_regions)], num_blocks)
    rng = np.random.default_rng(num_blocks)
    fa_blocks = rng.permutation(num_blocks - 1)[: num_blocks // 2]  # scattered, not in order
    ids = blocks(plan, list(fa_blocks), num_blocks - 1)
    tokens = len(fa_blocks) * lay.block_size - 3
    li, ri = read_indices(rl, ids, ids, num_tokens=tokens)
    assert li.dtype == np.int32 and ri.dtype == np.int32
    assert np.array_equal(li, ri)
    # The same descriptors as the reference view selects for the request (its order is
    # region-major: compared as sets of rows), the last kernel blocks past the tokens left out.
    ref = view.descs[descriptor_ids(lay, num_blocks, ids)]
    kernel_blocks = -(-tokens // lay.kernel_block_size)
    assert (kernel_blocks > 4096) == (num_blocks > 6)  # the large case really takes the strided path
    expected = []
    at = 0
    for group in lay.groups:
        for _ in group.layers:
            if group.kind == "attention":
                n = 2 * len(fa_blocks) * lay.physical_per_logical
                expected.append(ref[at : at + n].reshape(2, -1, 2)[:, :kernel_blocks].reshape(-1, 2))
            else:
                n = view.mamba_pieces
                expected.append(ref[at : at + n])
            at += n
    assert at == len(ref)

    def rows(a: np.ndarray) -> np.ndarray:
        return a[np.lexsort(a.T[::-1])]

    assert np.array_equal(rows(rl.local[li]), rows(np.concatenate(expected)))
    # Into caller-given buffers (reused across requests by the decode service): the same ids.
    big = (np.full(len(li) + 5, -1, dtype=np.int32), np.full(len(li) + 5, -1, dtype=np.int32))
    li2, ri2 = read_indices(rl, ids, ids, num_tokens=tokens, buffers=lambda n: big)
    assert np.array_equal(li2, li) and np.array_equal(ri2, ri)
    assert np.shares_memory(li2, big[0]) and big[0][-1] == -1
    with pytest.raises(LayoutError, match="buffers"):
        read_indices(rl, ids, ids, num_tokens=tokens, buffers=lambda n: (big[0][: n - 1], big[1]))
    with pytest.raises(LayoutError, match="buffers"):
        read_indices(rl, ids, ids, num_tokens=tokens, buffers=lambda n: (np.zeros(n, np.int64), big[1]))


def test_a_long_contiguous_request_still_merges_to_one_descriptor_per_fa_region() -> None:
    # > 4096 FA units per region take read_indices' strided path: its order must stay block-major.
    spec = get_preset("tiny-mamba2")
    lay = build_engine_layout(spec, 1, kernel_block_size=16)
    plan = build_plan(lay, lay)
    rl = lists_for(plan, 0, 0, n_local=2200, n_remote=2300)
    run = list(range(10, 2110))
    tokens = len(run) * lay.block_size
    li, ri = read_indices(rl, blocks(plan, run, 2150), blocks(plan, [b + 100 for b in run], 2250), num_tokens=tokens)
    assert -(-tokens // lay.kernel_block_size) > 4096
    is_fa = li < rl.local_geometry.fa_part
    fa_regions = sum(len(g.layers) for g in lay.groups if g.kind == "attention")
    assert wire_descriptors(rl, li[is_fa], ri[is_fa]) == fa_regions


@pytest.mark.parametrize(
    "name", ["tiny-mamba2", "tiny-mamba2-g1", "tiny-gdn", "tiny-mamba1", "nemotron-3-nano-30b-a3b", "falcon-h1-1.5b"]
)
def test_bytes_from_counts_equal_the_sum_over_the_ids(name: str) -> None:
    spec = get_preset(name)
    checked = 0
    for p_tp, d_tp, p_kernel, d_kernel in [(1, 1, 16, 16), (1, 2, 16, 16), (2, 1, 16, 32), (2, 4, 32, 16), (4, 2, 16, 16)]:
        try:
            plan = build_plan(
                build_engine_layout(spec, p_tp, kernel_block_size=p_kernel),
                build_engine_layout(spec, d_tp, kernel_block_size=d_kernel),
            )
        except LayoutError:
            continue  # TP does not divide this model's heads
        for d in range(d_tp):
            rank = plan.ranks[d]
            for p in sorted(set(rank.fa_sources) | set(rank.mamba_sources)):
                rl = lists_for(plan, d, p, n_local=9, n_remote=9)
                read = plan.ranks[d].read_from(p)
                for tokens in (0, 1, 17, plan.decode.block_size + 3, 3 * min(plan.decode.block_size, plan.prefill.block_size)):
                    local = blocks(plan, list(range(-(-tokens // plan.decode.block_size) or 1)), 8)
                    remote = [
                        np.array(list(range(-(-tokens // plan.prefill.block_size) or 1)))
                        if g.kind == "attention"
                        else np.array([8])
                        for g in plan.prefill.groups
                    ]
                    li, _ = read_indices(rl, local, remote, tokens)
                    reads_ssm = read.ssm is not None
                    assert rl.bytes_for(tokens, reads_ssm) == rl.bytes_by_section(li, reads_ssm), (p_tp, d_tp, d, p, tokens)
                    checked += 1
    assert checked >= 10


@pytest.mark.parametrize("p_kernel,d_kernel", [(16, 16), (16, 32), (32, 16)])
def test_parts_of_a_pipelined_transfer_select_the_whole_ids_once(p_kernel: int, d_kernel: int) -> None:
    """Parts [0, a), [a, b), [b, n) (FA only but the last, which adds the Mamba state) list
    exactly the ids of one read of n tokens, in order, and their bytes add up."""
    spec = get_preset("tiny-gdn")
    plan = build_plan(
        build_engine_layout(spec, 1, kernel_block_size=p_kernel), build_engine_layout(spec, 2, kernel_block_size=d_kernel)
    )
    rl = lists_for(plan, 1, 0, n_local=9, n_remote=9)
    local, remote = blocks(plan, [5, 0, 7], 3), blocks(plan, [2, 6, 8], 4)
    n, edges = 130, [0, 48, 96]
    whole = read_indices(rl, local, remote, n)
    parts = [
        read_indices(rl, local, remote, end, tokens_from=start, mamba=end == n)
        for start, end in zip(edges, [*edges[1:], n], strict=True)
    ]
    fa_whole, fa_parts = whole[0][whole[0] < rl.local_geometry.fa_part], [li[li < rl.local_geometry.fa_part] for li, _ in parts]
    assert sorted(np.concatenate(fa_parts).tolist()) == sorted(fa_whole.tolist())
    assert sorted(np.concatenate([li for li, _ in parts]).tolist()) == sorted(whole[0].tolist())
    assert sorted(np.concatenate([ri for _, ri in parts]).tolist()) == sorted(whole[1].tolist())
    assert all(not (li >= rl.local_geometry.fa_part).any() for li, _ in parts[:-1])  # Mamba with the last part only
    totals = [
        rl.bytes_for(end, True, tokens_from=start, mamba=end == n) for start, end in zip(edges, [*edges[1:], n], strict=True)
    ]
    assert tuple(map(sum, zip(*totals, strict=True))) == rl.bytes_for(n, True)
    with pytest.raises(LayoutError, match="tokens_from"):
        read_indices(rl, local, remote, n, tokens_from=plan.fa_unit_tokens + 1)


@pytest.mark.parametrize("p_kernel,d_kernel", [(16, 16), (32, 16), (16, 32)])
def test_skipped_tokens_drop_exactly_their_fa_units(p_kernel: int, d_kernel: int) -> None:
    """Decode's prefix cache: the ids with `tokens_from` are the full read's minus the K/V units
    of the skipped tokens (Mamba pieces all kept), and `bytes_for` counts what they move."""
    spec = get_preset("tiny-mamba2")
    plan = build_plan(
        build_engine_layout(spec, 1, kernel_block_size=p_kernel), build_engine_layout(spec, 1, kernel_block_size=d_kernel)
    )
    rl = lists_for(plan, 0, 0, n_local=9, n_remote=9)
    tokens = 3 * plan.decode.block_size + 5
    local = blocks(plan, list(range(-(-tokens // plan.decode.block_size))), 8)
    remote = [
        np.array(list(range(-(-tokens // plan.prefill.block_size)))) if g.kind == "attention" else np.array([8])
        for g in plan.prefill.groups
    ]
    full_l, full_r = read_indices(rl, local, remote, tokens)
    reads_ssm = plan.ranks[0].read_from(0).ssm is not None
    for skip in (0, rl.fa_unit_tokens, plan.decode.block_size, 2 * plan.decode.block_size):
        li, ri = read_indices(rl, local, remote, tokens, tokens_from=skip)
        kept = set(zip(li.tolist(), ri.tolist()))
        assert kept <= set(zip(full_l.tolist(), full_r.tolist()))
        dropped = len(full_l) - len(li)
        fa_units_dropped = (skip // rl.fa_unit_tokens) * rl.fa_pieces * len(plan.decode.groups[2].layers)
        assert dropped == fa_units_dropped, skip
        assert rl.bytes_for(tokens, reads_ssm, tokens_from=skip) == rl.bytes_by_section(li, reads_ssm)
        assert (li >= rl.local_geometry.fa_part).sum() == (full_l >= rl.local_geometry.fa_part).sum()
    with pytest.raises(LayoutError, match="tokens_from"):
        read_indices(rl, local, remote, tokens, tokens_from=rl.fa_unit_tokens + 1)
    with pytest.raises(LayoutError, match="tokens_from"):
        read_indices(rl, local, remote, tokens, tokens_from=tokens + rl.fa_unit_tokens)
