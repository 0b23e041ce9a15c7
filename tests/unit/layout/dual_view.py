"""Test oracle: the dual descriptor view of one rank's registered cache memory (layout-spec
section 3.3), vLLM's documented order. The data path does not use it: the read lists the
transport executes (`shared.layout.read_lists`) list the same descriptors per region
block-major; the tests compare them against this view. Both are built by `region_descriptors`.

One list, two sections over the same bytes, built from the region base addresses:

    FA section     for region j < R: K of every kernel block, then V of every kernel block
                       (base_j + b·L, L/2), (base_j + b·L + L/2, L/2)         b < N_phys
    Mamba section  for region j < R: each conv section s, then the SSM state
                       (base_j + m·P + offset_s, size_s), (base_j + m·P + conv_bytes, ssm_bytes)   m < N_log

Region-major: all blocks of one (region, piece) are consecutive, so consecutive block ids give
consecutive descriptor ids. Mamba descriptors are sized to the real state bytes, never the
padding. Descriptor ids for the blocks of a request (`descriptor_ids`):

    FA group, kernel block b, region j, half h   ->  (2j + h)·N_phys + b
    Mamba group, logical block m, region j, piece k  ->  2R·N_phys + (j·(S+1) + k)·N_log + m

Groups are emitted in group order, each region-major. Only the regions a group has a layer in
are listed (a padded short group has nothing in its last regions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.layout.descriptors import IntArray, region_descriptors
from shared.layout.page import EngineLayout
from shared.layout.spec import LayoutError


@dataclass(frozen=True)
class DualView:
    descs: IntArray  # (num_fa_descs + num_mamba_descs, 2): (addr, len)
    num_fa_descs: int  # 2R·N_phys: where the Mamba section starts
    num_logical_blocks: int
    num_kernel_blocks: int
    mamba_pieces: int  # S + 1 per region


def region_bases(bases: Sequence[int] | npt.ArrayLike, layout: EngineLayout) -> IntArray:
    arr = np.asarray(bases, dtype=np.int64).reshape(-1)
    if len(arr) != layout.num_regions:
        raise LayoutError(f"{len(arr)} region base addresses given, the layout has {layout.num_regions} regions")
    return arr


def dual_view(layout: EngineLayout, bases: Sequence[int] | npt.ArrayLike, num_logical_blocks: int) -> DualView:
    if num_logical_blocks < 1:
        raise LayoutError(f"num_logical_blocks must be >= 1, got {num_logical_blocks}")
    b = region_bases(bases, layout)
    n_phys = layout.num_kernel_blocks(num_logical_blocks)
    shapes = layout.shapes
    pieces = shapes.num_sections + 1
    num_fa = 2 * layout.num_regions * n_phys
    descs = np.empty((num_fa + layout.num_regions * pieces * num_logical_blocks, 2), dtype=np.int64)
    half = layout.kernel_page_bytes // 2
    region_descriptors(
        b,
        np.array([0, half], dtype=np.int64),
        np.array([half, half], dtype=np.int64),
        np.arange(n_phys, dtype=np.int64) * layout.kernel_page_bytes,
        out=descs[:num_fa],
    )
    region_descriptors(
        b,
        np.array([*shapes.section_offsets, shapes.conv_bytes], dtype=np.int64),
        np.array([*shapes.section_bytes, shapes.ssm_bytes], dtype=np.int64),
        np.arange(num_logical_blocks, dtype=np.int64) * layout.page_bytes,
        out=descs[num_fa:],
    )
    return DualView(
        descs=descs,
        num_fa_descs=num_fa,
        num_logical_blocks=num_logical_blocks,
        num_kernel_blocks=n_phys,
        mamba_pieces=pieces,
    )


def descriptor_ids(layout: EngineLayout, num_logical_blocks: int, block_ids_per_group: Sequence[npt.ArrayLike]) -> IntArray:
    """Dual-view descriptor ids of the given logical block ids (one array per group)."""
    if len(block_ids_per_group) != len(layout.groups):
        raise LayoutError(f"expected block ids for {len(layout.groups)} groups, got {len(block_ids_per_group)}")
    n_phys = layout.num_kernel_blocks(num_logical_blocks)
    num_fa = 2 * layout.num_regions * n_phys
    pieces = layout.shapes.num_sections + 1
    parts: list[IntArray] = []
    for g, group in enumerate(layout.groups):
        ids = np.asarray(block_ids_per_group[g], dtype=np.int64).reshape(-1)
        if np.any(ids < 0) or np.any(ids >= num_logical_blocks):
            raise LayoutError(f"group {g}: block id outside [0, {num_logical_blocks})")
        regions = np.arange(len(group.layers), dtype=np.int64)
        if group.kind == "attention":
            slots = (2 * regions[:, None] + np.arange(2, dtype=np.int64)[None, :]).reshape(-1)
            parts.append((slots[:, None] * n_phys + layout.kernel_block_ids(ids)[None, :]).reshape(-1))
        else:
            slots = (regions[:, None] * pieces + np.arange(pieces, dtype=np.int64)[None, :]).reshape(-1)
            parts.append((num_fa + slots[:, None] * num_logical_blocks + ids[None, :]).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
