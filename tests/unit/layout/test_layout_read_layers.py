"""Layer parts: read lists restricted to a contiguous range of model layers. Parts over a
partition of the layers list every (local, remote) pair of the whole read exactly once, in its
order; `bytes_for` counts what they move; ranges are validated; and the simulator moves real
bytes in layer parts through the plans the verifier tests use."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shared.layout.page import build_engine_layout
from shared.layout.plan import TransferPlan, build_plan
from shared.layout.presets import PRESETS, get_preset
from shared.layout.read_lists import ReadLists, read_indices
from shared.layout.shapes import valid_tp
from shared.layout.spec import LayoutError, ModelSpec, check_layer_range, layer_ranges, regions_in_layers
from shared.layout.verify import last_chunk_start, simulate_transfer, verify_plan
from tests.unit.layout.test_layout_read_lists import lists_for
from tests.unit.layout.test_layout_verify import GROUP_CASES, plan_for, proportional_bc_plan, specs

pytestmark = pytest.mark.timeout(180)


def request_ids(plan: TransferPlan, tokens: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Scattered block ids on both sides, enough for `tokens` tokens, disjoint across groups: the
    Mamba groups' blocks first, then every other block for K/V, in reverse (at most
    `len(groups) + 2 * fa_blocks + 2` blocks per side)."""
    out = []
    for layout, shift in ((plan.decode, 0), (plan.prefill, 1)):
        fa = max(1, -(-tokens // layout.block_size))
        first_fa = len(layout.groups) + shift
        out.append(
            [first_fa + np.arange(fa)[::-1] * 2 if g.kind == "attention" else np.array([i]) for i, g in enumerate(layout.groups)]
        )
    return out[0], out[1]


def partitions(num_layers: int) -> list[list[range]]:
    """Even splits into 1, 2, 3 and every-layer parts, and an uneven one."""
    out = [layer_ranges(num_layers, parts) for parts in sorted({1, min(2, num_layers), min(3, num_layers), num_layers})]
    if num_layers > 2:
        out.append([range(0, 1), range(1, num_layers - 1), range(num_layers - 1, num_layers)])
    return out


def pairs(li: np.ndarray, ri: np.ndarray) -> list[tuple[int, int]]:
    return list(zip(li.tolist(), ri.tolist(), strict=True))


def every_source(plan: TransferPlan) -> list[tuple[int, int]]:
    return [(d, read.prefill_rank) for d, rank in enumerate(plan.ranks) for read in rank.reads]


READ_CASES = [
    ("tiny-mamba2", 2, 4, (None, None)),
    ("tiny-mamba2", 4, 1, (16, 16)),
    ("tiny-gdn", 1, 2, (16, 32)),
    ("tiny-gdn", 2, 1, (32, 16)),
    ("tiny-mamba2-g1", 1, 2, (None, None)),
    ("tiny-mamba2-g2", 1, 4, (None, None)),
    ("nemotron-3-nano-30b-a3b", 4, 2, (16, None)),  # a short (padded) Mamba group
    ("falcon-h1-1.5b", 2, 1, (None, None)),  # parallel layers: both kinds in one layer
    ("jamba-reasoning-3b", 1, 1, (None, 16)),
]


@pytest.mark.parametrize(("name", "p", "d", "kernels"), READ_CASES)
def test_layer_parts_pair_every_id_of_the_whole_read_once(
    name: str, p: int, d: int, kernels: tuple[int | None, int | None]
) -> None:
    spec = get_preset(name)
    plan = build_plan(
        build_engine_layout(spec, p, kernel_block_size=kernels[0]), build_engine_layout(spec, d, kernel_block_size=kernels[1])
    )
    tokens = 2 * plan.decode.block_size + 5
    local, remote = request_ids(plan, tokens)
    for dec_rank, src_rank in every_source(plan):
        rl = lists_for(plan, dec_rank, src_rank, n_local=40, n_remote=40)
        reads_ssm = plan.ranks[dec_rank].read_from(src_rank).ssm is not None
        li, ri = read_indices(rl, local, remote, tokens)
        whole = pairs(li, ri)
        position = {pair: i for i, pair in enumerate(whole)}
        everything = read_indices(rl, local, remote, tokens, layers=range(spec.num_layers))
        assert all(np.array_equal(a, b) for a, b in zip(everything, (li, ri), strict=True))
        for partition in partitions(spec.num_layers):
            seen: list[tuple[int, int]] = []
            for layers in partition:
                part_l, part_r = read_indices(rl, local, remote, tokens, layers=layers)
                part = pairs(part_l, part_r)
                # The whole read's order, and its pairs: the same ids in the same positions.
                assert [position[pair] for pair in part] == sorted(position[pair] for pair in part), layers
                assert rl.bytes_for(tokens, reads_ssm, layers=layers) == rl.bytes_by_section(part_l, reads_ssm), layers
                seen += part
            assert len(seen) == len(whole) and set(seen) == set(whole), partition


def test_a_part_reads_exactly_the_regions_of_its_layers() -> None:
    spec = get_preset("tiny-mamba2")  # s a s s a s: attention (1, 4), Mamba (0, 3) and (2, 5)
    plan = plan_for(spec, 1, 1)
    rl = lists_for(plan, 0, 0, n_local=9, n_remote=9)
    tokens = plan.decode.block_size + 3
    local, remote = request_ids(plan, tokens)
    fa_part = rl.local_geometry.fa_part
    units = -(-tokens // rl.fa_unit_tokens)

    def read(layers: range, **kw: object) -> np.ndarray:
        return read_indices(rl, local, remote, tokens, layers=layers, **kw)[0]  # type: ignore[arg-type]

    attention_only = read(range(1, 2))
    assert len(attention_only) == units * rl.fa_pieces and (attention_only < fa_part).all()  # region 0 of the FA group
    assert rl.bytes_for(tokens, True, layers=range(1, 2))[1:] == (0, 0)
    ssm_only = read(range(2, 4))  # layer 2 (group 1, region 0) and 3 (group 0, region 1)
    assert (ssm_only >= fa_part).all() and len(ssm_only) == 2 * rl.mamba_pieces
    regions = (ssm_only - fa_part) // (rl.local_geometry.num_logical_blocks * rl.mamba_pieces)
    assert regions.tolist() == [1] * rl.mamba_pieces + [0] * rl.mamba_pieces  # group order: (0, 3) first
    assert len(read(range(0, 3), mamba=False)) == units * rl.fa_pieces  # K/V of layer 1 only
    assert len(read(range(2, 4), mamba=False)) == 0
    # A part past some units: tokens_from and layers together.
    later = read(range(4, 6), tokens_from=rl.fa_unit_tokens)
    assert (later < fa_part).sum() == (units - 1) * rl.fa_pieces and (later >= fa_part).sum() == rl.mamba_pieces


def test_layer_ranges_are_validated() -> None:
    plan = plan_for(get_preset("tiny-gdn"), 1, 1)
    rl = lists_for(plan, 0, 0)
    local, remote = request_ids(plan, 10)
    for bad in (range(-1, 2), range(0, 7), range(3, 3), range(4, 2), range(0, 6, 2)):
        with pytest.raises(LayoutError, match="layers"):
            check_layer_range(6, bad)
        with pytest.raises(LayoutError, match="layers"):
            read_indices(rl, local, remote, 10, layers=bad)
        with pytest.raises(LayoutError, match="layers"):
            rl.bytes_for(10, True, layers=bad)
    check_layer_range(6, range(0, 6))
    check_layer_range(6, range(5, 6))


def test_layer_ranges_split_the_layers_evenly_in_order() -> None:
    for num_layers, parts in itertools.product((1, 2, 5, 6, 52), (1, 2, 3, 4, 7)):
        if parts > num_layers:
            with pytest.raises(LayoutError, match="layer parts"):
                layer_ranges(num_layers, parts)
            continue
        ranges = layer_ranges(num_layers, parts)
        assert len(ranges) == parts and [i for r in ranges for i in r] == list(range(num_layers))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    assert layer_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(LayoutError, match="layer parts"):
        layer_ranges(4, 0)
    assert regions_in_layers((1, 4, 9), range(2, 9)) == slice(1, 2)
    assert regions_in_layers((1, 4, 9), range(5, 9)) == slice(2, 2)  # none: an empty slice
    assert regions_in_layers((1, 4, 9), range(0, 10)) == slice(0, 3)


# --- the simulator, in layer parts: every byte once, the same state as one read -----------------


@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 4), (4, 2), (2, 1)])
def test_simulator_in_layer_parts_hetero_tp(p: int, d: int, parts: int) -> None:
    plan = plan_for(get_preset("tiny-mamba2"), p, d)
    assert simulate_transfer(plan, num_tokens=33, layer_parts=parts) == []
    assert simulate_transfer(plan, num_tokens=40, layer_parts=parts, contiguous=True, seed=3) == []


@pytest.mark.parametrize(("kernels", "p", "d"), [((16, 32), 1, 2), ((32, 16), 2, 1), ((16, 16), 2, 2), ((8, 16), 4, 1)])
def test_simulator_in_layer_parts_different_block_sizes(kernels: tuple[int, int], p: int, d: int) -> None:
    spec = get_preset("tiny-gdn")
    plan = build_plan(
        build_engine_layout(spec, p, kernel_block_size=kernels[0]), build_engine_layout(spec, d, kernel_block_size=kernels[1])
    )
    assert last_chunk_start(70, plan.fa_unit_tokens) % plan.fa_unit_tokens == 0
    for tokens, parts in ((70, 3), (5, 2), (0, 6)):
        assert simulate_transfer(plan, num_tokens=tokens, layer_parts=parts) == [], (tokens, parts)


@pytest.mark.parametrize(("p", "d"), [(2, 4), (4, 2), (1, 2)])
def test_simulator_in_layer_parts_with_one_group(p: int, d: int) -> None:
    plan = plan_for(get_preset("tiny-mamba2-g1"), p, d)
    assert simulate_transfer(plan, num_tokens=20, layer_parts=3) == []
    # Negative control: a wrong plan is still caught when read in layer parts.
    assert any("conv state differs" in m for m in simulate_transfer(proportional_bc_plan(plan), num_tokens=20, layer_parts=3))


@pytest.mark.parametrize(("name", "p", "d"), GROUP_CASES)
def test_simulator_in_layer_parts_with_replicated_groups(name: str, p: int, d: int) -> None:
    plan = plan_for(PRESETS[name], p, d)
    assert simulate_transfer(plan, num_tokens=20, spare_blocks=1, layer_parts=5) == []


@pytest.mark.parametrize(
    ("name", "p", "d", "kernels"),
    [
        ("qwen3.5-0.8b", 4, 1, (None, 32)),
        ("jamba-reasoning-3b", 4, 1, (16, None)),
        ("granite-4.0-h-tiny", 1, 4, (None, None)),
        ("nemotron-3-nano-30b-a3b", 16, 4, (16, None)),
        ("falcon-h1-1.5b", 2, 4, (16, 16)),
    ],
)
def test_simulator_in_layer_parts_real_models(name: str, p: int, d: int, kernels: tuple[int | None, int | None]) -> None:
    spec = PRESETS[name]
    plan = build_plan(
        build_engine_layout(spec, p, kernel_block_size=kernels[0]), build_engine_layout(spec, d, kernel_block_size=kernels[1])
    )
    for parts in (2, 7, spec.num_layers):
        assert simulate_transfer(plan, num_tokens=33, spare_blocks=1, layer_parts=parts) == [], parts


@settings(deadline=None, max_examples=25)
@given(
    spec=specs(),
    p=st.sampled_from((1, 2, 4)),
    d=st.sampled_from((1, 2, 4)),
    kernels=st.tuples(st.sampled_from([None, 1, 2, 4]), st.sampled_from([None, 1, 2, 4])),
    tokens=st.integers(0, 40),
    parts=st.integers(1, 7),
    seed=st.integers(0, 1000),
)
def test_simulated_transfer_in_layer_parts_round_trips(
    spec: ModelSpec, p: int, d: int, kernels: tuple[int | None, int | None], tokens: int, parts: int, seed: int
) -> None:
    assume(valid_tp(spec, p) and valid_tp(spec, d))
    plan = build_plan(
        build_engine_layout(spec, p, kernel_block_size=kernels[0]), build_engine_layout(spec, d, kernel_block_size=kernels[1])
    )
    assert verify_plan(plan) == []
    assert simulate_transfer(plan, num_tokens=tokens, seed=seed, layer_parts=min(parts, spec.num_layers)) == []


def test_lists_know_the_models_layers() -> None:
    plan = plan_for(get_preset("nemotron-3-nano-30b-a3b"), 2, 2)
    rl: ReadLists = lists_for(plan, 0, 0)
    assert rl.num_layers == 52
    assert [s.stop - s.start for s in rl.region_slices(range(0, 10))] == [2, 1, 1, 1, 1]  # (0, 9) (2) (4) (7) (5)
    assert rl.region_slices(None) == tuple(slice(0, len(g.layers)) for g in rl.groups)
