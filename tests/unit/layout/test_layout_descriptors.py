"""The dual descriptor view and its descriptor ids, against a loop-by-loop reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.presets import PRESETS, TINY_PRESETS, get_preset
from shared.layout.shapes import valid_tp
from shared.layout.spec import LayoutError
from tests.unit.layout.dual_view import descriptor_ids, dual_view

pytestmark = pytest.mark.timeout(120)
LAYOUT_SETTINGS = settings(deadline=None, max_examples=30)


def reference_descs(lay: EngineLayout, bases: list[int], ids_per_group: list[list[int]]) -> list[tuple[int, int]]:
    """What a request's blocks cover, written out with loops in id order."""
    out: list[tuple[int, int]] = []
    s = lay.shapes
    for g, group in enumerate(lay.groups):
        for j in range(len(group.layers)):
            if group.kind == "attention":
                for half in (0, 1):
                    for logical in ids_per_group[g]:
                        for k in range(lay.physical_per_logical):
                            b = logical * lay.physical_per_logical + k
                            out.append(
                                (
                                    bases[j] + b * lay.kernel_page_bytes + half * lay.kernel_page_bytes // 2,
                                    lay.kernel_page_bytes // 2,
                                )
                            )
            else:
                pieces = [*zip(s.section_offsets, s.section_bytes), (s.conv_bytes, s.ssm_bytes)]
                for offset, size in pieces:
                    for m in ids_per_group[g]:
                        out.append((bases[j] + m * lay.page_bytes + offset, size))
    return out


def test_counts_and_addresses() -> None:
    lay = build_engine_layout(get_preset("tiny-mamba2"), 1, kernel_block_size=16)  # R = 2, r = 2
    bases = [1_000_000, 2_000_000]
    view = dual_view(lay, bases, 5)
    assert view.num_kernel_blocks == 10
    assert view.num_fa_descs == 2 * 2 * 10
    assert len(view.descs) == 40 + 2 * 4 * 5
    half = lay.kernel_page_bytes // 2
    assert view.descs[0].tolist() == [1_000_000, half]
    assert view.descs[10].tolist() == [1_000_000 + half, half]  # V of kernel block 0
    assert view.descs[21].tolist() == [2_000_000 + lay.kernel_page_bytes, half]  # region 1, K, block 1
    s = lay.shapes
    assert view.descs[40].tolist() == [1_000_000, s.section_bytes[0]]
    assert view.descs[40 + 5 * 3 + 2].tolist() == [1_000_000 + 2 * lay.page_bytes + s.conv_bytes, s.ssm_bytes]
    # Never the padding: every Mamba descriptor ends inside the real state.
    mamba = view.descs[40:]
    page_offset = (mamba[:, 0] - np.repeat(bases, 4 * 5)) % lay.page_bytes
    assert np.all(page_offset + mamba[:, 1] <= lay.mamba_bytes)


@st.composite
def cases(draw: st.DrawFn) -> tuple[EngineLayout, int, list[list[int]]]:
    name = draw(st.sampled_from(sorted(PRESETS)))
    spec = PRESETS[name]
    tp = draw(st.sampled_from([tp for tp in (1, 2, 4, 8) if valid_tp(spec, tp)]))
    lay = build_engine_layout(spec, tp)
    kernels = [k for k in (lay.block_size, lay.block_size // 2, 16) if k and lay.block_size % k == 0]
    lay = build_engine_layout(spec, tp, kernel_block_size=draw(st.sampled_from(kernels)))
    n_groups = len(lay.groups)
    counts = [draw(st.integers(0, 3)) if g.kind == "attention" else draw(st.integers(0, 1)) for g in lay.groups]
    num_blocks = sum(counts) + draw(st.integers(1, 4))
    pool = draw(st.permutations(range(num_blocks)))
    cuts = np.cumsum([0, *counts])
    return lay, num_blocks, [list(pool[cuts[g] : cuts[g + 1]]) for g in range(n_groups)]


@LAYOUT_SETTINGS
@given(case=cases())
def test_ids_select_exactly_the_reference_descriptors(case: tuple[EngineLayout, int, list[list[int]]]) -> None:
    lay, num_blocks, ids_per_group = case
    bases = [(j + 1) << 34 for j in range(lay.num_regions)]
    view = dual_view(lay, bases, num_blocks)
    ids = descriptor_ids(lay, num_blocks, [np.array(x, dtype=np.int64) for x in ids_per_group])
    assert len(np.unique(ids)) == len(ids)
    assert [tuple(d) for d in view.descs[ids].tolist()] == reference_descs(lay, bases, ids_per_group)


@pytest.mark.parametrize("name", [*sorted(TINY_PRESETS), "nemotron-3-nano-30b-a3b", "falcon-h1-1.5b"])
def test_ids_of_all_blocks_are_a_bijection_onto_the_group_range(name: str) -> None:
    lay = build_engine_layout(PRESETS[name], 2, kernel_block_size=16)
    n = 3
    view = dual_view(lay, [j << 34 for j in range(lay.num_regions)], n)
    pieces = lay.shapes.num_sections + 1
    for g, group in enumerate(lay.groups):
        all_blocks = [np.arange(n) if i == g else np.zeros(0, dtype=np.int64) for i in range(len(lay.groups))]
        ids = np.sort(descriptor_ids(lay, n, all_blocks))
        regions = len(group.layers)
        if group.kind == "attention":
            expected = np.arange(2 * regions * view.num_kernel_blocks)
        else:
            expected = view.num_fa_descs + np.arange(regions * pieces * n)
        assert np.array_equal(ids, expected)


def test_contiguous_blocks_give_contiguous_ids() -> None:
    lay = build_engine_layout(get_preset("tiny-gdn"), 2, kernel_block_size=16)
    fa = lay.attention_group_ids[0]
    blocks = [np.zeros(0, dtype=np.int64)] * len(lay.groups)
    blocks[fa] = np.arange(4, 8)
    ids = descriptor_ids(lay, 10, blocks)
    runs = ids.reshape(-1, 4 * lay.physical_per_logical)  # one run per (region, K/V)
    assert np.all(np.diff(runs, axis=1) == 1)


def test_errors() -> None:
    lay = build_engine_layout(get_preset("tiny-mamba2"), 1)
    with pytest.raises(LayoutError, match="3 groups"):
        descriptor_ids(lay, 4, [np.arange(1)])
    with pytest.raises(LayoutError, match="outside"):
        descriptor_ids(lay, 4, [np.array([4]), np.array([0]), np.array([1])])
    with pytest.raises(LayoutError, match="region base"):
        dual_view(lay, [0], 4)
    with pytest.raises(LayoutError, match=">= 1"):
        dual_view(lay, [0, 1 << 30], 0)
