"""Digests of a request's transferred state: one per (prefill rank, section, layer group).

Prefill takes them right after it wrote the state; decode recomputes them from what its READs
left in its own blocks and compares before its first model step. They prove that decode holds
exactly the bytes prefill wrote, across hosts and hardware, without recomputing anything.

The digested bytes are defined by the model, not by either side's memory: for prefill rank p,
section `fa` of an attention group is, layer by layer, K then V, and for each KV head p holds
(in the layout's order), that head's `[token, head_dim]` rows of the request's tokens; `conv`
and `ssm` of a Mamba group are the conv channels and SSM rows p holds, layer by layer. Who holds
what comes from the layout's index functions, so a decode engine of another TP size or block
size finds the same bytes in its own ranks (each global index from the lowest local rank holding
it) and gets the same digest. Padding and bytes outside the request are never digested.

A layer part of a pipelined transfer (`layers=`, a contiguous range of model layers) has
digests of the same keys, each covering the group's layers in the range only, in the same
order; a group with no layer in the range has none.

That order is the one the cache keeps within a kernel block (`[K|V, head, slot, head_dim]`), so
every piece is hashed where it lies, one contiguous slab per (layer, K|V, head, kernel block):
nothing is copied (a device cache: one host copy per layer of just the request's kernel blocks),
and the cost is one pass of the hash over the bytes plus one small step per slab. That step is a
memoryview slice, not a tensor index: at ~5 us of torch dispatch per index, 2048 tokens of
nemotron-3-nano (3072 slabs of 4 KiB) cost several times the hash pass over all 62 MB.

xxh3-128 (the `xxhash` package): not cryptographic, which integrity against corruption does not
need, and several times faster than BLAKE3 or SHA-2 on one core.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
import xxhash
from torch import Tensor

from shared.cache.model_views import RankViews
from shared.layout.page import EngineLayout
from shared.layout.shapes import conv_channel_index, kv_head_index, ssm_row_index
from shared.layout.spec import check_layer_range, regions_in_layers

DIGEST_ALGORITHM = "xxh3-128"
Section = Literal["fa", "conv", "ssm"]
SECTIONS: tuple[Section, ...] = ("fa", "conv", "ssm")
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class SectionDigest:
    rank: int  # the prefill rank whose bytes these are
    section: Section
    group: int  # KV-cache group (index into the layout's groups)
    digest: bytes


@dataclass(frozen=True)
class DigestMismatch:
    rank: int
    section: Section
    group: int
    layers: tuple[int, ...]

    def describe(self) -> str:
        return f"prefill rank {self.rank}, {self.section} of layer group {self.group} (layers {list(self.layers)})"


@dataclass(frozen=True)
class _Run:
    """`length` consecutive wanted indices, from `start` on, served by local rank `rank` at
    consecutive local positions from `local`: one contiguous slice of that rank's state."""

    rank: int
    start: int
    local: int
    length: int


class _Owners:
    """For global indices of one kind (KV heads, conv channels, SSM rows): which local rank and
    local position serve each, the lowest rank holding it winning."""

    def __init__(self, per_rank: Sequence[IntArray]) -> None:
        size = max((int(ids.max()) + 1 for ids in per_rank if ids.size), default=0)
        self.rank = np.full(size, -1, dtype=np.int64)
        self.position = np.zeros(size, dtype=np.int64)
        for r in reversed(range(len(per_rank))):
            self.rank[per_rank[r]] = r
            self.position[per_rank[r]] = np.arange(per_rank[r].size)

    def runs(self, wanted: IntArray) -> list[_Run]:
        """`wanted` in order, as slices of local ranks (few: TP splits indices into ranges)."""
        ranks, local = self.rank[wanted], self.position[wanted]
        if (ranks < 0).any():
            raise ValueError("the local engine holds none of some indices the source rank holds")
        breaks = np.flatnonzero((np.diff(ranks) != 0) | (np.diff(local) != 1)) + 1
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), int(wanted.size)]
        return [_Run(int(ranks[a]), a, int(local[a]), b - a) for a, b in zip(starts, ends) if b > a]


def _own_runs(per_rank: Sequence[IntArray], rank: int) -> list[_Run]:
    return [_Run(rank, 0, 0, int(per_rank[rank].size))] if per_rank[rank].size else []


_INDEX = {"fa": kv_head_index, "conv": conv_channel_index, "ssm": ssm_row_index}


@dataclass(frozen=True)
class DigestPlan:
    """Where the pieces of each source rank's digests lie among this engine's ranks: per section
    and source rank, the runs of local slices to hash, in order. It depends on the two layouts
    only, not on a request, so `digest_plan` builds it once per pair of layouts (prefill: its
    own; decode: once per prefill layout it reads from) and every digest call reuses it."""

    source_tp: int
    runs: dict[Section, tuple[tuple[_Run, ...], ...]]  # [section][source rank]

    def local_ranks(self, section: Section) -> list[int]:
        """The local ranks any source rank's `section` is read from, in order."""
        return sorted({r.rank for runs in self.runs[section] for r in runs})


@functools.lru_cache(maxsize=64)
def digest_plan(layout: EngineLayout, source: EngineLayout | None = None) -> DigestPlan:
    """The `DigestPlan` of digests of `source`'s ranks (None: this engine's own, each rank its
    own bytes) taken from an engine of `layout`; memoized, the layouts being frozen."""
    spec, local_tp = layout.spec, layout.tp
    src_tp = layout.tp if source is None else source.tp
    runs: dict[Section, tuple[tuple[_Run, ...], ...]] = {}
    for section in SECTIONS:
        index = _INDEX[section]
        local = [index(spec, local_tp, r) for r in range(local_tp)]
        if source is None:
            runs[section] = tuple(tuple(_own_runs(local, p)) for p in range(src_tp))
        else:
            owners = _Owners(local)
            runs[section] = tuple(tuple(owners.runs(index(spec, src_tp, p))) for p in range(src_tp))
    return DigestPlan(src_tp, runs)


def _bytes(t: Tensor) -> memoryview:
    """`t`'s bytes as one flat run, without a copy where `t` is contiguous in host memory."""
    return t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().data


@dataclass(frozen=True)
class _TokenSpans:
    """Tokens of a request, kernel block by kernel block in token order: kernel block
    `blocks[i]` holds them at slots `[starts[i], stops[i])`."""

    blocks: IntArray
    starts: IntArray
    stops: IntArray


def token_spans(layout: EngineLayout, block_ids: npt.ArrayLike, tokens_from: int, num_tokens: int) -> _TokenSpans:
    """Where tokens `[tokens_from, num_tokens)` of a request lie, kernel block by kernel block, in
    token order."""
    size = layout.kernel_block_size
    ids = layout.kernel_block_ids(block_ids)
    needed = -(-num_tokens // size)
    if ids.size < needed:
        raise IndexError(f"{num_tokens} tokens need {needed} kernel blocks, the request has {ids.size}")
    first = np.arange(tokens_from // size, needed, dtype=np.int64) * size  # each kernel block's first token
    starts = np.maximum(first, tokens_from) - first
    stops = np.minimum(first + size, num_tokens) - first
    return _TokenSpans(ids[tokens_from // size : needed], starts, stops)


def state_digests(
    layout: EngineLayout,
    ranks: Sequence[RankViews],
    block_ids: Sequence[npt.ArrayLike],
    num_tokens: int,
    *,
    source: EngineLayout | None = None,
    tokens_from: int = 0,
    sections: Sequence[Section] = SECTIONS,
    layers: range | None = None,
) -> list[SectionDigest]:
    """Digests of one request's state in `ranks` (this engine's, in rank order), as the ranks of
    `source` hold it: K/V of tokens `[tokens_from, num_tokens)`, and the conv and SSM state (the
    state after `num_tokens`), for the sections in `sections`. `source=None`: this engine is the
    source, and each rank digests its own bytes (prefill); else the bytes are found in the local
    ranks (decode). Everything is hashed where it lies; every source rank's digest of a group is
    taken in the same pass over its layers, so each layer's bytes are fetched once. `layers` (a
    layer part; None: every layer): only the regions whose layer is in that range."""
    if not 0 <= tokens_from <= num_tokens:
        raise ValueError(f"tokens [{tokens_from}, {num_tokens}) is not a token range")
    plan = digest_plan(layout, source)
    per_rank: list[list[SectionDigest]] = [[] for _ in range(plan.source_tp)]
    for g, (group, regions) in enumerate(zip(layout.groups, _regions(layout, layers), strict=True)):
        if not regions:
            continue  # no layer of this group in the part
        if group.kind == "attention":
            if "fa" in sections:
                spans = token_spans(layout, block_ids[g], tokens_from, num_tokens)
                digests = _fa_digests(layout, ranks, spans, plan.runs["fa"], plan.local_ranks("fa"), regions)
                for p, digest in enumerate(digests):
                    per_rank[p].append(SectionDigest(p, "fa", g, digest))
            continue
        block = int(np.asarray(block_ids[g]).reshape(-1)[0])
        for section in ("conv", "ssm"):
            if section not in sections:
                continue
            digests = _mamba_digests(ranks, block, section, plan.runs[section], plan.local_ranks(section), regions)
            for p, digest in enumerate(digests):
                per_rank[p].append(SectionDigest(p, section, g, digest))
    return [d for digests in per_rank for d in digests]


def _regions(layout: EngineLayout, layers: range | None) -> list[range]:
    """Per group: its regions whose layer is in `layers` (None: all of them)."""
    if layers is None:
        return [range(len(group.layers)) for group in layout.groups]
    check_layer_range(layout.spec.num_layers, layers)
    return [range(len(group.layers))[regions_in_layers(group.layers, layers)] for group in layout.groups]


def _mamba_digests(
    ranks: Sequence[RankViews],
    block: int,
    section: Section,
    runs: Sequence[Sequence[_Run]],
    local_ranks: Sequence[int],
    regions: range,
) -> list[bytes]:
    """One Mamba group's conv or SSM state for every source rank: layer by layer (`regions`), the
    rows the source rank holds, each run a byte slice of the local rank's state of that layer."""
    hashers = [xxhash.xxh3_128() for _ in runs]
    for region in regions:
        rows = {}  # local rank -> (that layer's state as bytes, bytes per row)
        for r in local_ranks:
            state = (ranks[r].conv if section == "conv" else ranks[r].ssm)[region][block]
            data = _bytes(state)
            rows[r] = (data, data.nbytes // state.shape[0])
        for h, source_runs in zip(hashers, runs):
            for run in source_runs:
                data, row = rows[run.rank]
                h.update(data[run.local * row : (run.local + run.length) * row])
    return [h.digest() for h in hashers]


def block_digests(
    layout: EngineLayout, ranks: Sequence[RankViews], block_ids: Sequence[npt.ArrayLike], indices: Sequence[int]
) -> list[tuple[SectionDigest, ...]]:
    """The FA digests of whole blocks `indices` of a request (`block_ids`, one array per group),
    each exactly `state_digests(..., sections=("fa",))` of that block alone as a one-block
    request, every rank its own bytes: the same bytes in the same order, but in one pass over
    all the blocks (one host copy per layer of a device cache, not one per block)."""
    indices = list(indices)
    if not indices:
        return []
    per_block = layout.physical_per_logical  # kernel blocks (spans) of one whole block
    head_runs = digest_plan(layout).runs["fa"]
    out: list[list[SectionDigest]] = [[] for _ in indices]
    for p in range(layout.tp):
        for g, group in enumerate(layout.groups):
            if group.kind != "attention":
                continue
            ids = np.asarray(block_ids[g], dtype=np.int64).reshape(-1)[indices]
            spans = token_spans(layout, ids, 0, ids.size * layout.block_size)
            fa = _FaBytes(layout, spans)
            hashers = [xxhash.xxh3_128() for _ in indices]
            for region in range(len(group.layers)):
                data, starts, stops = fa.layer(ranks[p].fa[region])
                for kv in (0, 1):
                    for r in head_runs[p]:
                        for head in range(r.local, r.local + r.length):
                            for k, h in enumerate(hashers):
                                mine = slice(k * per_block, (k + 1) * per_block)  # block k's kernel blocks
                                for start, stop in zip(starts[kv][head][mine], stops[kv][head][mine]):
                                    h.update(data[start:stop])
            for k, h in enumerate(hashers):
                out[k].append(SectionDigest(p, "fa", g, h.digest()))
    return [tuple(d) for d in out]


def _fa_digests(
    layout: EngineLayout,
    ranks: Sequence[RankViews],
    spans: _TokenSpans,
    runs: Sequence[Sequence[_Run]],
    local_ranks: Sequence[int],
    regions: range,
) -> list[bytes]:
    """One attention group's K/V for every source rank: layer by layer (`regions`), K then V,
    head by head, the head's tokens in order, each kernel block's rows hashed where they lie."""
    hashers = [xxhash.xxh3_128() for _ in runs]
    fa = {r: _FaBytes(layout, spans) for r in local_ranks}
    for region in regions:
        layer = {r: fa[r].layer(ranks[r].fa[region]) for r in local_ranks}
        for h, source_runs in zip(hashers, runs):
            update = h.update
            for kv in (0, 1):
                for run in source_runs:
                    data, starts, stops = layer[run.rank]
                    for head in range(run.local, run.local + run.length):
                        for start, stop in zip(starts[kv][head], stops[kv][head]):
                            update(data[start:stop])
    return [h.digest() for h in hashers]


SlabOffsets = list[list[list[int]]]  # [K|V][head] -> one offset per kernel block of the spans


class _FaBytes:
    """The K/V of the spans' tokens on one local rank, layer by layer, as host bytes, and where in
    them each head's rows lie: one contiguous slab per kernel block. The bytes are the cache
    itself where it is in host memory (nothing copied); a device cache is copied to the host once
    per layer, just the spans' kernel blocks, not slab by slab. The slab offsets come from the
    layout (`EngineLayout.fa_offset`) and are the same for every layer, so they are computed once
    for the cache itself and once for a copy."""

    def __init__(self, layout: EngineLayout, spans: _TokenSpans) -> None:
        self._layout = layout
        self._spans = spans
        self._offsets: dict[bool, tuple[SlabOffsets, SlabOffsets]] = {}

    def layer(self, fa: Tensor) -> tuple[memoryview, SlabOffsets, SlabOffsets]:
        """One layer's bytes, and the (starts, stops) in them of every head's K and V slabs."""
        spans = self._spans
        raw = fa.view(torch.uint8)  # [kernel block, K|V, head, slot, head_dim bytes]
        copied = raw.device.type != "cpu" or not raw.is_contiguous()
        if copied:  # the spans' kernel blocks, in order, contiguous: kernel block i of the copy
            raw = raw.index_select(0, torch.from_numpy(spans.blocks).to(raw.device)).cpu().contiguous()
        offsets = self._offsets.get(copied)
        if offsets is None:
            offsets = self._offsets[copied] = self._slabs(copied)
        starts, stops = offsets
        return raw.reshape(-1).numpy().data, starts, stops

    def _slabs(self, copied: bool) -> tuple[SlabOffsets, SlabOffsets]:
        spans, layout = self._spans, self._layout
        blocks = (np.arange(spans.blocks.size, dtype=np.int64) if copied else spans.blocks)[None, None, :]
        kv = np.arange(2)[:, None, None]
        heads = np.arange(layout.shapes.kv_heads_per_rank)[None, :, None]
        # A head's slots in a kernel block are one run of bytes: [K|V, head, kernel block].
        starts = layout.fa_offset(blocks, kv, heads, spans.starts[None, None, :])
        stops = layout.fa_offset(blocks, kv, heads, spans.stops[None, None, :])
        return starts.tolist(), stops.tolist()


def compare_digests(
    layout: EngineLayout, expected: Sequence[SectionDigest], got: Sequence[SectionDigest], layers: range | None = None
) -> list[DigestMismatch]:
    """Every (rank, section, group) whose digests differ, or that only one side has; each names
    the group's layers the digests cover (those in `layers`, a layer part's range; None: all)."""
    want = {(d.rank, d.section, d.group): d.digest for d in expected}
    have = {(d.rank, d.section, d.group): d.digest for d in got}
    bad = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    regions = _regions(layout, layers)
    return [DigestMismatch(r, s, g, layout.groups[g].layers[regions[g].start : regions[g].stop]) for r, s, g in bad]
