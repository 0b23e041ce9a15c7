"""The hybrid page layout of one engine rank, as vLLM's hybrid memory allocator (HMA) builds it.

Grouping (vLLM `_get_kv_cache_groups_uniform_page_size`): cache layers are bucketed by kind
(attention, mamba) in order of first appearance; a Falcon-H1 "parallel" layer contributes
one attention cache layer and one mamba cache layer (attention first). With `g` the smallest
bucket (or the largest, when every bucket is below 1.5 g), each bucket of n layers is cut
into ceil(n / g) groups, group i taking the bucket's layers i, i + G, i + 2G ... Region
(registered tensor) j is shared by the j-th layer of every group, so there are R = g regions;
a short group leaves its last regions unused.

Page size: the FA block size (tokens) is raised until one FA page holds one Mamba page:
`block_size = a * ceil(mamba_bytes / (a * fa_bytes_per_token))` with alignment `a` (16 by
default; lcm(a, kernel block size) when a kernel block size is given). A requested block size
below that is raised (and recorded); a larger one is kept. Page `P = block_size *
fa_bytes_per_token`; the Mamba state is padded up to P.

Byte layout of one region (N logical blocks of P bytes each; both views cover the same bytes):
- FA view: N * r kernel blocks of `L = P / r` bytes, r = block_size / kernel_block_size; a
  kernel block is HND `[2 (K, V), kv_heads_per_rank, kernel_block_size, head_dim]`, K half first.
- Mamba view: logical block m at `m * P`: conv state DS `(conv_dim, conv_rows)` at offset 0 with
  its sections consecutive, SSM state at offset `conv_bytes`, padding after `mamba_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from shared.layout.shapes import RankShapes, rank_shapes
from shared.layout.spec import LayoutError, ModelSpec

GroupKind = Literal["attention", "mamba"]
IntArray = npt.NDArray[np.int64]
DEFAULT_ALIGNMENT = 16


@dataclass(frozen=True)
class LayerGroup:
    """One KV-cache group: layers of one kind; `layers[j]` lives in region j."""

    kind: GroupKind
    layers: tuple[int, ...]


def hma_groups(spec: ModelSpec) -> tuple[LayerGroup, ...]:
    """Group the model's cache layers as vLLM's HMA does (see the module docstring)."""
    buckets: dict[GroupKind, list[int]] = {}
    for i, kind in enumerate(spec.layer_kinds):
        if kind in ("attention", "parallel"):
            buckets.setdefault("attention", []).append(i)
        if kind in ("ssm", "parallel"):
            buckets.setdefault("mamba", []).append(i)
    if set(buckets) != {"attention", "mamba"}:
        raise LayoutError(f"{spec.name}: a hybrid layout needs attention and SSM layers")
    sizes = [len(v) for v in buckets.values()]
    g = min(sizes)
    if max(sizes) < 1.5 * g:
        g = max(sizes)
    groups: list[LayerGroup] = []
    for group_kind, layers in buckets.items():
        n_groups = math.ceil(len(layers) / g)
        groups += [LayerGroup(group_kind, tuple(layers[i::n_groups])) for i in range(n_groups)]
    return tuple(groups)


def min_block_size(shapes: RankShapes, alignment: int) -> int:
    per = alignment * shapes.fa_bytes_per_token
    return alignment * -(-shapes.mamba_bytes // per)


@dataclass(frozen=True)
class EngineLayout:
    """Everything about one rank's cache memory that does not depend on addresses or counts."""

    spec: ModelSpec
    tp: int
    shapes: RankShapes
    groups: tuple[LayerGroup, ...]
    num_regions: int  # R
    alignment: int  # effective: lcm(requested alignment, kernel block size) when a kernel size is given
    min_block_size: int
    requested_block_size: int | None
    block_size_raised: bool
    block_size: int  # logical (scheduler) block size, tokens
    kernel_block_size: int  # attention kernel block size, tokens
    physical_per_logical: int  # r
    page_bytes: int  # P: one logical block of one region
    kernel_page_bytes: int  # L = P / r: one kernel block of one region (FA view)
    mamba_bytes: int  # real conv + SSM bytes of one logical block of one region
    padding_bytes: int  # P - mamba_bytes

    # --- groups and regions -------------------------------------------------------------
    @property
    def attention_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if g.kind == "attention")

    @property
    def mamba_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if g.kind == "mamba")

    def region_of(self, kind: GroupKind, layer: int) -> int:
        """Region holding `layer`'s cache of `kind` (Falcon-H1 layers have both kinds)."""
        return self._locate(kind, layer)[1]

    def group_of(self, kind: GroupKind, layer: int) -> int:
        return self._locate(kind, layer)[0]

    def _locate(self, kind: GroupKind, layer: int) -> tuple[int, int]:
        for gi, group in enumerate(self.groups):
            if group.kind == kind and layer in group.layers:
                return gi, group.layers.index(layer)
        raise LayoutError(f"layer {layer} has no {kind} cache")

    def region_bytes(self, num_logical_blocks: int) -> int:
        return num_logical_blocks * self.page_bytes

    # --- FA view ------------------------------------------------------------------------
    # The one definition of the FA page: a kernel block is HND `fa_block_shape`, C order, so byte
    # offsets follow from it in `fa_offset`; the cache's torch views, the digests and the read
    # lists all take them from here.
    @property
    def fa_block_shape(self) -> tuple[int, int, int, int]:
        """One kernel block of one region, in elements: [2 (K, V), kv_heads_per_rank, kernel_block_size, head_dim]."""
        return (2, self.shapes.kv_heads_per_rank, self.kernel_block_size, self.shapes.head_dim)

    def fa_offset(self, kernel_block: npt.ArrayLike, kv: npt.ArrayLike, head: npt.ArrayLike, slot: npt.ArrayLike) -> IntArray:
        """Byte offset in a region of token slot `slot` of local head `head`'s K (`kv` 0) or V (1)
        in kernel block `kernel_block` (numpy broadcasting over the four)."""
        i64 = np.int64
        return (
            np.asarray(kernel_block, dtype=i64) * self.kernel_page_bytes
            + np.asarray(kv, dtype=i64) * (self.kernel_page_bytes // 2)
            + np.asarray(head, dtype=i64) * self.fa_head_bytes
            + np.asarray(slot, dtype=i64) * self.fa_token_bytes
        )

    @property
    def fa_head_bytes(self) -> int:
        """K (or V) bytes of one head in one kernel block."""
        return self.kernel_block_size * self.shapes.head_dim * self.shapes.kv_dtype_bytes

    @property
    def fa_token_bytes(self) -> int:
        """K (or V) bytes of one head for one token."""
        return self.shapes.head_dim * self.shapes.kv_dtype_bytes

    def num_kernel_blocks(self, num_logical_blocks: int) -> int:
        return num_logical_blocks * self.physical_per_logical

    def blocks_per_group(self, num_tokens: int) -> list[int]:
        """Logical blocks each group needs for `num_tokens` tokens (Mamba groups: always 1)."""
        per_fa = -(-num_tokens // self.block_size)
        return [per_fa if g.kind == "attention" else 1 for g in self.groups]

    def token_slots(self, block_ids: npt.ArrayLike, positions: npt.ArrayLike) -> tuple[IntArray, IntArray]:
        """(kernel block id, slot in that kernel block) of each token position of a request whose
        attention group holds logical blocks `block_ids`. IndexError when a position has no block."""
        ids = np.asarray(block_ids, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        logical = pos // self.block_size
        if logical.size and int(logical.max()) >= ids.size:
            raise IndexError(f"position {int(pos.max())} needs {int(logical.max()) + 1} blocks, the request has {ids.size}")
        within = pos % self.block_size
        return ids[logical] * self.physical_per_logical + within // self.kernel_block_size, within % self.kernel_block_size

    def kernel_block_ids(self, logical_ids: npt.ArrayLike) -> IntArray:
        """Logical ids -> the kernel block ids they cover, in order (FA groups only)."""
        ids = np.asarray(logical_ids, dtype=np.int64).reshape(-1)
        r = self.physical_per_logical
        return (ids[:, None] * r + np.arange(r, dtype=np.int64)[None, :]).reshape(-1)

    # --- Mamba view ---------------------------------------------------------------------
    @property
    def section_offsets(self) -> tuple[int, ...]:
        """Page offset of each conv section."""
        return self.shapes.section_offsets


def build_engine_layout(
    spec: ModelSpec,
    tp: int,
    *,
    block_size: int | None = None,
    kernel_block_size: int | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> EngineLayout:
    """One rank's layout for `spec` at TP `tp` (every rank of an engine has the same one)."""
    if alignment < 1:
        raise LayoutError(f"alignment must be >= 1, got {alignment}")
    if block_size is not None and block_size < 1:
        raise LayoutError(f"block size must be >= 1, got {block_size}")
    if kernel_block_size is not None and kernel_block_size < 1:
        raise LayoutError(f"kernel block size must be >= 1, got {kernel_block_size}")
    shapes = rank_shapes(spec, tp)
    groups = hma_groups(spec)
    # The kernel block must tile the logical block, so the computed size aligns to both.
    align = alignment if kernel_block_size is None else math.lcm(alignment, kernel_block_size)
    minimum = min_block_size(shapes, align)
    logical = minimum if block_size is None or block_size < minimum else block_size
    kernel = logical if kernel_block_size is None else kernel_block_size
    if logical % kernel:
        raise LayoutError(f"kernel block size {kernel} does not divide block size {logical}")
    page = logical * shapes.fa_bytes_per_token
    r = logical // kernel
    return EngineLayout(
        spec=spec,
        tp=tp,
        shapes=shapes,
        groups=groups,
        num_regions=max(len(g.layers) for g in groups),
        alignment=align,
        min_block_size=minimum,
        requested_block_size=block_size,
        block_size_raised=block_size is not None and block_size < minimum,
        block_size=logical,
        kernel_block_size=kernel,
        physical_per_logical=r,
        page_bytes=page,
        kernel_page_bytes=page // r,
        mamba_bytes=shapes.mamba_bytes,
        padding_bytes=page - shapes.mamba_bytes,
    )
