"""HMA grouping, block sizes, page bytes and offsets (vLLM's documented values)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shared.layout.page import LayerGroup, build_engine_layout, hma_groups
from shared.layout.presets import get_preset
from shared.layout.spec import LayoutError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("model", "sizes"),
    [
        ("tiny-mamba2", (32, 32, 16, 16)),
        ("tiny-mamba2-g1", (32, 32, 16, 16)),
        ("tiny-gdn", (48, 48, 32, 16)),
        ("tiny-mamba1", (32, 32, 16, 16)),
    ],
)
def test_tiny_block_sizes(model: str, sizes: tuple[int, ...]) -> None:
    """hybrid-models.md section 3.2: vLLM's formula with alignment 16."""
    assert tuple(build_engine_layout(get_preset(model), tp).block_size for tp in (1, 2, 4, 8)) == sizes


def test_nano_block_sizes() -> None:
    """hybrid-models.md 1.7: Nemotron-3-Nano gets 2096 at TP 2 and 1056 at TP 4 (bf16 KV)."""
    nano = get_preset("nemotron-3-nano-30b-a3b")
    assert build_engine_layout(nano, 2).block_size == 2096
    assert build_engine_layout(nano, 4).block_size == 1056


def test_nano_fp8_physical_per_logical() -> None:
    """layout-spec 6.5: fp8 KV, 16-token kernel: r = 261 at TP 1 and 2, 131 at TP 4."""
    nano = get_preset("nemotron-3-nano-30b-a3b").with_dtypes(kv="fp8")
    ratios = [build_engine_layout(nano, tp, kernel_block_size=16).physical_per_logical for tp in (1, 2, 4)]
    assert ratios == [261, 261, 131]


def test_page_and_padding() -> None:
    lay = build_engine_layout(get_preset("tiny-mamba2"), 1)
    assert lay.page_bytes == 32 * 256 == lay.kernel_page_bytes
    assert lay.mamba_bytes == 6912 and lay.padding_bytes == 8192 - 6912
    assert lay.shapes.ssm_offset == 3072 and lay.section_offsets == (0, 96 * 12, 176 * 12)
    nano = build_engine_layout(get_preset("nemotron-3-nano-30b-a3b"), 2)
    assert nano.page_bytes == 2096 * 512 and nano.mamba_bytes == 18432 + 1048576
    assert nano.page_bytes >= nano.mamba_bytes > nano.page_bytes - 16 * 512


def test_block_size_raise_and_keep() -> None:
    spec = get_preset("tiny-mamba2")
    raised = build_engine_layout(spec, 1, block_size=16)
    assert (raised.block_size, raised.requested_block_size, raised.block_size_raised) == (32, 16, True)
    kept = build_engine_layout(spec, 1, block_size=100)
    assert (kept.block_size, kept.block_size_raised) == (100, False)
    assert kept.page_bytes == 100 * 256 and kept.padding_bytes == 100 * 256 - 6912
    auto = build_engine_layout(spec, 1)
    assert (auto.requested_block_size, auto.block_size_raised) == (None, False)


def test_alignment_and_kernel_block_size() -> None:
    spec = get_preset("tiny-mamba2")
    assert build_engine_layout(spec, 1, alignment=1).block_size == 27  # ceil(6912 / 256)
    assert build_engine_layout(spec, 1, alignment=64).block_size == 64
    lay = build_engine_layout(spec, 1, kernel_block_size=8)
    assert (lay.block_size, lay.kernel_block_size, lay.physical_per_logical) == (32, 8, 4)
    assert lay.kernel_page_bytes * 4 == lay.page_bytes
    # A kernel block size the aligned size does not hold raises the alignment to it.
    lay = build_engine_layout(spec, 1, kernel_block_size=48)
    assert (lay.block_size, lay.physical_per_logical, lay.alignment) == (48, 1, 48)
    with pytest.raises(LayoutError, match="does not divide block size 100"):
        build_engine_layout(spec, 1, block_size=100, kernel_block_size=16)
    for bad in ({"alignment": 0}, {"block_size": 0}, {"kernel_block_size": -1}):
        with pytest.raises(LayoutError):
            build_engine_layout(spec, 1, **bad)  # type: ignore[arg-type]


def test_grouping_tiny() -> None:
    groups = hma_groups(get_preset("tiny-mamba2"))  # S A S S A S
    assert groups == (LayerGroup("mamba", (0, 3)), LayerGroup("mamba", (2, 5)), LayerGroup("attention", (1, 4)))
    lay = build_engine_layout(get_preset("tiny-mamba2"), 2)
    assert lay.num_regions == 2
    assert [lay.region_of("mamba", i) for i in (0, 2, 3, 5)] == [0, 0, 1, 1]
    assert [lay.region_of("attention", i) for i in (1, 4)] == [0, 1]
    assert lay.group_of("mamba", 5) == 1 and lay.attention_group_ids == (2,) and lay.mamba_group_ids == (0, 1)
    with pytest.raises(LayoutError, match="no attention cache"):
        lay.region_of("attention", 0)


def test_grouping_nano_pads_the_short_group() -> None:
    """6 attention, 23 Mamba layers: g = 6, Mamba cut into 4 strided groups of 6, 6, 6, 5."""
    spec = get_preset("nemotron-3-nano-30b-a3b")
    groups = hma_groups(spec)
    mamba = list(spec.ssm_layers)
    assert [g.kind for g in groups] == ["mamba"] * 4 + ["attention"]
    assert [len(g.layers) for g in groups] == [6, 6, 6, 5, 6]
    assert groups[1].layers == tuple(mamba[1::4])
    assert groups[4].layers == spec.attention_layers
    assert build_engine_layout(spec, 1).num_regions == 6


def test_grouping_uses_the_largest_bucket_when_close() -> None:
    # 4 attention and 5 SSM layers: 5 < 1.5 * 4, so g = 5 (one group each, attention padded).
    spec = dataclasses.replace(
        get_preset("tiny-mamba2"),
        layer_kinds=tuple(["ssm", "attention", "ssm", "attention", "ssm", "attention", "ssm", "attention", "ssm"]),
    )
    groups = hma_groups(spec)
    assert [len(g.layers) for g in groups] == [5, 4]
    assert build_engine_layout(spec, 1).num_regions == 5


def test_falcon_parallel_layers_share_regions() -> None:
    spec = get_preset("falcon-h1-1.5b")
    lay = build_engine_layout(spec, 2)
    assert [g.kind for g in lay.groups] == ["attention", "mamba"]
    assert lay.num_regions == 24
    assert all(lay.region_of("attention", i) == lay.region_of("mamba", i) == i for i in range(24))


def test_fa_offsets_are_the_c_order_offsets_of_the_kernel_block_shape() -> None:
    lay = build_engine_layout(get_preset("tiny-mamba2"), 1, block_size=32, kernel_block_size=16)
    shape = (lay.num_kernel_blocks(2), *lay.fa_block_shape)
    element = lay.shapes.kv_dtype_bytes
    expected = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) * element
    idx = np.indices(shape, dtype=np.int64)
    assert np.array_equal(lay.fa_offset(idx[0], idx[1], idx[2], idx[3]) + idx[4] * element, expected)
    assert shape[0] * lay.kernel_page_bytes == lay.region_bytes(2)


def test_fa_view_sizes_hnd() -> None:
    lay = build_engine_layout(get_preset("tiny-mamba2"), 1, kernel_block_size=16)  # 2 KV heads, head_dim 16, fp32
    assert lay.fa_head_bytes == 16 * 16 * 4 and lay.fa_offset(0, 1, 0, 0) == lay.kernel_page_bytes // 2 == 2 * lay.fa_head_bytes
    assert lay.kernel_block_ids(np.array([3, 0])).tolist() == [6, 7, 0, 1]
    assert lay.num_kernel_blocks(5) == 10 and lay.region_bytes(5) == 5 * lay.page_bytes


def test_hybrid_layout_needs_both_kinds() -> None:
    spec = dataclasses.replace(get_preset("tiny-mamba2"), layer_kinds=("ssm", "mlp"))
    with pytest.raises(LayoutError, match="needs attention and SSM"):
        hma_groups(spec)
