"""The data-path contract the transport executes: descriptor lists per (decode rank, source rank)
and, per request, the index arrays that pair them.

Design
------
For one decode rank d and one source prefill rank p, `build_read_lists` prepares two
descriptor lists once per peer (NIXL `prep_xfer_dlist`): `local` over d's regions and `remote`
over p's regions, each an `(n, 2)` int64 array of `(addr, len)`. Both lists have the same
*structure*; only their block counts differ (each side has its own number of blocks, kernel
block size and physical-per-logical ratio):

    FA part     for region j < R, for FA unit u, for piece k < 2·F (K pieces then V pieces):
                    id   = (j·U + u)·2F + k
                    addr = base_j + kernel_block(u)·L + half(k)·L/2 + head_offset(k) + sub_unit(u)
    Mamba part  for region j < R, for logical block m, for piece k < M (conv sections read
                from p, then SSM):
                    id   = fa_part + (j·N + m)·M + k
                    addr = base_j + m·P + offset_k

(U: FA units per region, N: logical blocks per region, both of this side.)

Why block-major inside a region, not vLLM's region, piece, block order (the reference view in
`descriptors`): NIXL's `make_prepped_xfer` merges a run of consecutive indices over adjacent
equal-size descriptors into one wire descriptor, and every unmerged descriptor costs a few µs.
A kernel block is [2, heads, kernel_block_size, head_dim], K half first, so K_u, V_u, K_u+1 ...
are adjacent in memory whenever a piece covers a whole half (equal kernel block sizes, every
head read); so are x|B|C|SSM of one Mamba page whenever whole sections are read. Block-major
ids make these runs consecutive as well, and the FA part of a contiguously allocated request
merges to one wire descriptor per region (measured: docs/performance.md). NIXL merges equal
sizes only, so of a Mamba page only equal-size neighbours (B|C) merge.

An FA unit is `fa_unit_tokens` tokens (the gcd of the two sides' kernel block sizes), so a
side whose kernel blocks are larger has several units per kernel block. With equal kernel block
sizes one piece per half covers every head read from p (F = 1, one descriptor per K or V of a
kernel block, as vLLM). With different kernel block sizes heads are not adjacent any more in
both layouts, so there is one piece per head (F = heads read): more, smaller descriptors.
Only pieces that move bytes are listed: a source that holds no needed KV head has no FA part,
and a replicated B/C section (groups replicated across ranks) read from another source has no
Mamba piece here.

Mamba descriptors cover the real state bytes only, never the page padding. Local descriptors
already point at the split destination when P_TP > D_TP (each source fills its own slice of
d's sections), so no descriptor is ever written by two sources.

Per request, `read_indices` maps the logical block ids of every KV-cache group on both sides
to descriptor ids: FA groups expand each side's logical ids with that side's ratio r to kernel
blocks and then to units, keeping the units that cover `num_tokens`; each Mamba group has
exactly one logical block. Ids are emitted group by group, region, block (FA unit), then
piece, on both sides in the same order, so `local_idx[i]` pairs with `remote_idx[i]` and both
descriptors have the same length. Consecutive blocks give consecutive ids, so NIXL can merge
descriptors of contiguously allocated blocks. One READ per (d, p) then moves FA and Mamba
state of every layer at once. Code that classifies ids (FA, conv, SSM) asks the lists
(`fa_part`, `mamba_piece_of`) rather than re-deriving this order.

A layer part of a pipelined transfer (`layers=`: a contiguous range of model layers) reads the
same ids restricted to the regions whose layer is in the range: a group's regions hold its
layers in increasing order, so that is one slice of regions per group (none for a group with
no layer in the range), and the ids keep their relative order and pairing. Parts over a
partition of the model's layers list each id of the whole read exactly once.

Pieces of a padded (short) group's unused regions are never referenced: they hold nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.layout.descriptors import region_descriptors
from shared.layout.page import EngineLayout, LayerGroup
from shared.layout.plan import SourceRead, TransferPlan
from shared.layout.spec import LayoutError, check_layer_range, regions_in_layers

IntArray = npt.NDArray[np.int64]
IdArray = npt.NDArray[np.int32]
"""Descriptor ids as NIXL takes them (int32): half the memory of int64 for millions of ids, and
nothing to convert before `make_prepped_xfer`."""
MAX_DESCRIPTORS = 2**31 - 1  # ids must fit int32


@dataclass(frozen=True)
class SideGeometry:
    """One side's block geometry as seen by one (d, p) read list."""

    num_logical_blocks: int
    physical_per_logical: int  # r
    units_per_kernel_block: int  # kernel block size / FA unit tokens
    fa_part: int  # descriptors in the FA part (the Mamba part starts here)

    @property
    def num_units(self) -> int:
        return self.num_logical_blocks * self.physical_per_logical * self.units_per_kernel_block


@dataclass(frozen=True)
class ReadLists:
    decode_rank: int
    prefill_rank: int
    groups: tuple[LayerGroup, ...]
    num_layers: int  # the model's layers: the bounds of a layer part's range
    fa_unit_tokens: int
    fa_pieces: int  # pieces per region in the FA part (2·F; 0: no FA from this source)
    mamba_pieces: int  # pieces per region in the Mamba part
    local_geometry: SideGeometry
    remote_geometry: SideGeometry
    local: IntArray  # (n_local, 2) (addr, len) over the decode rank's regions
    remote: IntArray  # (n_remote, 2) (addr, len) over the prefill rank's regions

    @cached_property
    def region_starts(self) -> tuple[_RegionStarts | None, ...]:
        """Per group: the first descriptor id of each of its regions on both sides (None: the
        group moves nothing from this source). Depends on the lists only: computed once per peer."""
        lg, rg = self.local_geometry, self.remote_geometry
        starts: list[_RegionStarts | None] = []
        for group in self.groups:
            regions = np.arange(len(group.layers), dtype=np.int32)
            if group.kind == "attention":
                if not self.fa_pieces:
                    starts.append(None)
                    continue
                local = regions * (lg.num_units * self.fa_pieces)
                remote = regions * (rg.num_units * self.fa_pieces)
            else:
                if not self.mamba_pieces:
                    starts.append(None)
                    continue
                local = lg.fa_part + regions * (lg.num_logical_blocks * self.mamba_pieces)
                remote = rg.fa_part + regions * (rg.num_logical_blocks * self.mamba_pieces)
            starts.append(_RegionStarts(local.astype(np.int32), remote.astype(np.int32)) if len(regions) else None)
        return tuple(starts)

    def bytes_by_section(self, local_ids: npt.NDArray[np.integer[Any]], reads_ssm: bool) -> tuple[int, int, int]:
        """(FA, conv, SSM) bytes the given local descriptor ids move; `reads_ssm`: whether this
        source's Mamba pieces end with the SSM state (the plan's `SourceRead.ssm` is not None)."""
        lengths = self.local[local_ids, 1]
        is_fa = local_ids < self.local_geometry.fa_part
        fa = int(lengths[is_fa].sum())
        if not self.mamba_pieces:
            return fa, 0, 0
        mamba = lengths[~is_fa]
        if not reads_ssm:
            return fa, int(mamba.sum()), 0
        is_ssm = self.mamba_piece_of(local_ids[~is_fa]) == self.mamba_pieces - 1
        return fa, int(mamba[~is_ssm].sum()), int(mamba[is_ssm].sum())

    def region_slices(self, layers: range | None) -> tuple[slice, ...]:
        """Per group: the slice of its regions whose layer is in `layers` (None: all of them)."""
        if layers is None:
            return tuple(slice(0, len(group.layers)) for group in self.groups)
        check_layer_range(self.num_layers, layers)
        return tuple(regions_in_layers(group.layers, layers) for group in self.groups)

    def bytes_for(
        self,
        num_tokens: int,
        reads_ssm: bool,
        *,
        tokens_from: int = 0,
        mamba: bool = True,
        layers: range | None = None,
    ) -> tuple[int, int, int]:
        """(FA, conv, SSM) bytes that `read_indices(..., num_tokens, tokens_from=, mamba=,
        layers=)` moves: what `bytes_by_section` sums over its ids, from counts alone (no per-id
        work), since every region of a group moves the same pieces."""
        num_units = -(-num_tokens // self.fa_unit_tokens) - tokens_from // self.fa_unit_tokens
        fa_unit_bytes, mamba_sizes = self._piece_bytes
        conv_bytes = sum(mamba_sizes[:-1]) if reads_ssm else sum(mamba_sizes)
        ssm_bytes = mamba_sizes[-1] if reads_ssm and mamba_sizes else 0
        fa = conv = ssm = 0
        for group, starts, selected in zip(self.groups, self.region_starts, self.region_slices(layers)):
            if starts is None:
                continue
            regions = selected.stop - selected.start
            if group.kind == "attention":
                fa += regions * num_units * fa_unit_bytes
            elif mamba:
                conv += regions * conv_bytes
                ssm += regions * ssm_bytes
        return fa, conv, ssm

    @cached_property
    def _piece_bytes(self) -> tuple[int, tuple[int, ...]]:
        """Bytes of one FA unit's pieces, and each Mamba piece's size (the first region's first
        unit and block: every region and block repeats them)."""
        fa_part = self.local_geometry.fa_part
        fa_unit = int(self.local[: self.fa_pieces, 1].sum()) if fa_part else 0
        mamba = self.local[fa_part : fa_part + self.mamba_pieces, 1]
        return fa_unit, tuple(int(x) for x in mamba)

    def mamba_piece_of(self, local_ids: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.integer[Any]]:
        """Piece index (conv sections read from this source, then SSM) of local ids in the Mamba
        part (ids >= `local_geometry.fa_part`)."""
        return (local_ids - self.local_geometry.fa_part) % max(self.mamba_pieces, 1)


@dataclass(frozen=True)
class _RegionStarts:
    local: IdArray
    remote: IdArray


def _as_bases(bases: Sequence[int] | IntArray, layout: EngineLayout, side: str) -> IntArray:
    arr = np.asarray(bases, dtype=np.int64).reshape(-1)
    if len(arr) != layout.num_regions:
        raise LayoutError(f"{side}: {len(arr)} region base addresses, layout has {layout.num_regions} regions")
    return arr


def _fa_side(
    layout: EngineLayout, read: SourceRead, unit_tokens: int, per_head: bool, local: bool, num_logical: int
) -> tuple[IntArray, IntArray, IntArray]:
    """(piece offsets, piece sizes, unit offsets) of one side's FA part."""
    assert read.fa is not None
    token_bytes = layout.fa_token_bytes
    head_unit = unit_tokens * token_bytes
    first_head = (read.fa.local_offset if local else read.fa.remote_offset) // head_unit
    num_heads = read.fa.size // head_unit
    kb = layout.kernel_block_size
    heads = np.arange(num_heads, dtype=np.int64) if per_head else np.zeros(1, dtype=np.int64)
    # K of every head, then V of every head, at a kernel block's first slot.
    offsets = layout.fa_offset(0, np.arange(2)[:, None], (first_head + heads)[None, :], 0).reshape(-1)
    size = unit_tokens * token_bytes if per_head else num_heads * kb * token_bytes
    q = kb // unit_tokens
    units = np.arange(num_logical * layout.physical_per_logical * q, dtype=np.int64)
    unit_offsets = layout.fa_offset(units // q, 0, 0, (units % q) * unit_tokens)
    return offsets, np.full(len(offsets), size, dtype=np.int64), unit_offsets


def build_read_lists(
    plan: TransferPlan,
    decode_rank: int,
    prefill_rank: int,
    *,
    local_bases: Sequence[int] | IntArray,
    remote_bases: Sequence[int] | IntArray,
    local_num_blocks: int,
    remote_num_blocks: int,
) -> ReadLists:
    """Descriptor lists for decode rank `decode_rank` reading from `prefill_rank` (once per peer).

    `*_bases`: base address of each region (registration order); `*_num_blocks`: logical blocks
    per region on each side.
    """
    if not 0 <= decode_rank < len(plan.ranks):
        raise LayoutError(f"decode rank {decode_rank} is outside decode TP {len(plan.ranks)}")
    read = plan.ranks[decode_rank].read_from(prefill_rank)
    dec, pre = plan.decode, plan.prefill
    lb, rb = _as_bases(local_bases, dec, "local"), _as_bases(remote_bases, pre, "remote")
    if local_num_blocks < 1 or remote_num_blocks < 1:
        raise LayoutError("block counts must be >= 1")
    c = plan.fa_unit_tokens
    per_head = dec.kernel_block_size != pre.kernel_block_size
    mamba = read.mamba_reads
    sizes = np.array([m.size for m in mamba], dtype=np.int64)

    def side(layout: EngineLayout, bases: IntArray, num_blocks: int, local: bool) -> tuple[IntArray, int, int]:
        """This side's list: FA part (if any) then Mamba part, written in place."""
        fa = _fa_side(layout, read, c, per_head, local, num_blocks) if read.fa is not None else None
        fa_len = 0 if fa is None else len(bases) * len(fa[0]) * len(fa[2])
        descs = np.empty((fa_len + len(bases) * len(mamba) * num_blocks, 2), dtype=np.int64)
        if fa is not None:
            region_descriptors(bases, *fa, out=descs[:fa_len], block_major=True)
        region_descriptors(
            bases,
            np.array([m.local_offset if local else m.remote_offset for m in mamba], dtype=np.int64),
            sizes,
            np.arange(num_blocks, dtype=np.int64) * layout.page_bytes,
            out=descs[fa_len:],
            block_major=True,
        )
        return descs, fa_len, 0 if fa is None else len(fa[0])

    local, local_fa, fa_pieces = side(dec, lb, local_num_blocks, True)
    remote, remote_fa, _ = side(pre, rb, remote_num_blocks, False)
    if max(len(local), len(remote)) > MAX_DESCRIPTORS:
        raise LayoutError(
            f"{max(len(local), len(remote))} descriptors in one list: NIXL indexes them with int32 "
            f"(at most {MAX_DESCRIPTORS}); use fewer blocks per engine"
        )
    return ReadLists(
        decode_rank=decode_rank,
        prefill_rank=prefill_rank,
        groups=dec.groups,
        num_layers=dec.spec.num_layers,
        fa_unit_tokens=c,
        fa_pieces=fa_pieces,
        mamba_pieces=len(mamba),
        local_geometry=SideGeometry(local_num_blocks, dec.physical_per_logical, dec.kernel_block_size // c, local_fa),
        remote_geometry=SideGeometry(remote_num_blocks, pre.physical_per_logical, pre.kernel_block_size // c, remote_fa),
        local=local,
        remote=remote,
    )


def _units(geometry: SideGeometry, logical_ids: IntArray, num_units: int, side: str, group: int) -> IntArray:
    """Logical block ids -> the first `num_units` FA unit ids they cover."""
    per_logical = geometry.physical_per_logical * geometry.units_per_kernel_block
    if len(logical_ids) * per_logical < num_units:
        raise LayoutError(
            f"{side} group {group}: {len(logical_ids)} blocks hold {len(logical_ids) * per_logical} FA units, {num_units} needed"
        )
    if logical_ids.min() < 0 or logical_ids.max() >= geometry.num_logical_blocks:
        raise LayoutError(f"{side} group {group}: block id outside [0, {geometry.num_logical_blocks})")
    if per_logical == 1:
        return logical_ids[:num_units]
    needed = -(-num_units // per_logical)
    units = (logical_ids[:needed, None] * per_logical + np.arange(per_logical, dtype=np.int64)[None, :]).reshape(-1)
    return units[:num_units]


def _mamba_block(geometry: SideGeometry, logical_ids: IntArray, side: str, group: int) -> int:
    if len(logical_ids) != 1:
        raise LayoutError(f"{side} group {group} (mamba): expected exactly 1 block id, got {len(logical_ids)}")
    block = int(logical_ids[0])
    if not 0 <= block < geometry.num_logical_blocks:
        raise LayoutError(f"{side} group {group}: block id {block} outside [0, {geometry.num_logical_blocks})")
    return block


def _block_pieces(blocks: IntArray, pieces: int) -> IdArray:
    """Ids within a region of every piece of the given blocks (FA units or logical blocks),
    block-major: the list order inside a region. int32 is exact: every id is below the list
    length, checked against MAX_DESCRIPTORS when the lists were built."""
    first = blocks.astype(np.int32) * np.int32(pieces)
    if len(first) < 4096:  # small: one broadcast add is the fewest calls
        return (first[:, None] + np.arange(pieces, dtype=np.int32)[None, :]).reshape(-1)
    out = np.empty((len(first), pieces), dtype=np.int32)
    # One strided pass per piece: a broadcast add whose inner axis is the few pieces costs numpy
    # a loop setup per block (measured 10x slower for 100k blocks of 2 pieces).
    for piece in range(pieces):
        np.add(first, np.int32(piece), out=out[:, piece])
    return out.reshape(-1)


def _one_block_pieces(block: int, pieces: int) -> IdArray:
    """`_block_pieces` of one block, in one numpy call (every request's Mamba groups)."""
    return np.arange(block * pieces, (block + 1) * pieces, dtype=np.int32)


def read_indices(
    lists: ReadLists,
    local_block_ids_per_group: Sequence[npt.ArrayLike],
    remote_block_ids_per_group: Sequence[npt.ArrayLike],
    num_tokens: int,
    *,
    buffers: Callable[[int], tuple[IdArray, IdArray]] | None = None,
    tokens_from: int = 0,
    mamba: bool = True,
    layers: range | None = None,
) -> tuple[IdArray, IdArray]:
    """Paired descriptor ids (local, remote) moving one request's state for `num_tokens` tokens.

    `tokens_from` (a multiple of the FA unit) leaves out the FA units of the tokens before it:
    decode's prefix cache holds their K/V already (in the same local blocks), or an earlier part
    of a pipelined transfer moved it. `mamba=False` (a part before the last) leaves out the conv
    and SSM state. `layers` (a layer part; None: every layer) keeps only the regions whose model
    layer is in that range, of every group: the K/V of its attention layers and, with `mamba`,
    the state of its SSM layers.

    Runs on every request: the per-peer part (region starts) is cached on the lists, and each id
    is written once, straight into the two output arrays (long prompts give millions of ids), as
    int32, the index type of NIXL. `buffers(count)`, if given, supplies the two output arrays
    (at least `count` long; the result is their first `count` ids): arrays reused across
    requests skip the page faults of fresh ones.
    """
    n_groups = len(lists.groups)
    if len(local_block_ids_per_group) != n_groups or len(remote_block_ids_per_group) != n_groups:
        raise LayoutError(
            f"expected block ids for {n_groups} groups, got {len(local_block_ids_per_group)} local "
            f"and {len(remote_block_ids_per_group)} remote"
        )
    if num_tokens < 0:
        raise LayoutError(f"num_tokens must be >= 0, got {num_tokens}")
    if not 0 <= tokens_from <= num_tokens or tokens_from % lists.fa_unit_tokens:
        raise LayoutError(
            f"tokens_from {tokens_from}: must be a multiple of the FA unit ({lists.fa_unit_tokens} tokens) in [0, {num_tokens}]"
        )
    lg, rg = lists.local_geometry, lists.remote_geometry
    num_units = -(-num_tokens // lists.fa_unit_tokens)
    first_unit = tokens_from // lists.fa_unit_tokens
    selected = None if layers is None else lists.region_slices(layers)
    # (region starts, local offsets, remote offsets) per group that moves bytes: one row of ids
    # per region, `start + offset` for every offset (the pieces of its units or its one block).
    parts: list[tuple[_RegionStarts, IdArray, IdArray]] = []
    for g, (group, starts) in enumerate(zip(lists.groups, lists.region_starts)):
        if starts is None or (group.kind == "attention" and num_units == first_unit) or (group.kind != "attention" and not mamba):
            continue
        if selected is not None:
            regions = selected[g]
            if regions.start == regions.stop:
                continue  # no layer of this group in the part
            starts = _RegionStarts(starts.local[regions], starts.remote[regions])
        lids = np.asarray(local_block_ids_per_group[g], dtype=np.int64).reshape(-1)
        rids = np.asarray(remote_block_ids_per_group[g], dtype=np.int64).reshape(-1)
        if group.kind == "attention":
            lu = _units(lg, lids, num_units, "local", g)[first_unit:]
            ru = _units(rg, rids, num_units, "remote", g)[first_unit:]
            parts.append((starts, _block_pieces(lu, lists.fa_pieces), _block_pieces(ru, lists.fa_pieces)))
        else:
            lm, rm = _mamba_block(lg, lids, "local", g), _mamba_block(rg, rids, "remote", g)
            parts.append((starts, _one_block_pieces(lm, lists.mamba_pieces), _one_block_pieces(rm, lists.mamba_pieces)))
    total = sum(len(starts.local) * len(offsets) for starts, offsets, _ in parts)
    if buffers is None:
        local_idx = np.empty(total, dtype=np.int32)
        remote_idx = np.empty(total, dtype=np.int32)
    else:
        local_buf, remote_buf = buffers(total)
        if min(len(local_buf), len(remote_buf)) < total or local_buf.dtype != np.int32 or remote_buf.dtype != np.int32:
            raise LayoutError(
                f"buffers({total}) returned {local_buf.dtype}[{len(local_buf)}] and {remote_buf.dtype}[{len(remote_buf)}]"
            )
        local_idx, remote_idx = local_buf[:total], remote_buf[:total]
    at = 0
    for starts, local_off, remote_off in parts:
        shape = (len(starts.local), len(local_off))
        end = at + shape[0] * shape[1]
        np.add(starts.local[:, None], local_off[None, :], out=local_idx[at:end].reshape(shape))
        np.add(starts.remote[:, None], remote_off[None, :], out=remote_idx[at:end].reshape(shape))
        at = end
    return local_idx, remote_idx
