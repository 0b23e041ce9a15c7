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


def _bytes(t: Tensor) -> memoryview:
    """`t`'s bytes, without a copy where `t` is contiguous in host memory."""
    return t.contiguous().view(torch.uint8).cpu().numpy().data


@dataclass(frozen=True)
class _TokenSpan:
    """Tokens `[start, stop)` of kernel block `block`, as slot numbers within it."""

    block: int
    start: int
    stop: int


def token_spans(layout: EngineLayout, block_ids: npt.ArrayLike, tokens_from: int, num_tokens: int) -> list[_TokenSpan]:
    """Where tokens `[tokens_from, num_tokens)` of a request lie, kernel block by kernel block, in
    token order."""
    size = layout.kernel_block_size
    ids = layout.kernel_block_ids(block_ids)
    needed = -(-num_tokens // size)
    if ids.size < needed:
        raise IndexError(f"{num_tokens} tokens need {needed} kernel blocks, the request has {ids.size}")
    spans = []
    for i in range(tokens_from // size, needed):
        first, last = max(tokens_from, i * size), min(num_tokens, (i + 1) * size)
        spans.append(_TokenSpan(int(ids[i]), first - i * size, last - i * size))
    return spans


def state_digests(
    layout: EngineLayout,
    ranks: Sequence[RankViews],
    block_ids: Sequence[npt.ArrayLike],
    num_tokens: int,
    *,
    source: EngineLayout | None = None,
    tokens_from: int = 0,
    sections: Sequence[Section] = SECTIONS,
) -> list[SectionDigest]:
    """Digests of one request's state in `ranks` (this engine's, in rank order), as the ranks of
    `source` hold it: K/V of tokens `[tokens_from, num_tokens)`, and the conv and SSM state (the
    state after `num_tokens`), for the sections in `sections`. `source=None`: this engine is the
    source, and each rank digests its own bytes (prefill); else the bytes are found in the local
    ranks (decode). Everything is hashed where it lies."""
    if not 0 <= tokens_from <= num_tokens:
        raise ValueError(f"tokens [{tokens_from}, {num_tokens}) is not a token range")
    spec = layout.spec
    src = source if source is not None else layout
    local_tp = layout.tp
    local_index = {
        "fa": [kv_head_index(spec, local_tp, r) for r in range(local_tp)],
        "conv": [conv_channel_index(spec, local_tp, r) for r in range(local_tp)],
        "ssm": [ssm_row_index(spec, local_tp, r) for r in range(local_tp)],
    }
    owners = {kind: _Owners(ids) for kind, ids in local_index.items()}
    source_index = {
        "fa": kv_head_index, "conv": conv_channel_index, "ssm": ssm_row_index,
    }  # fmt: skip
    group_spans = {
        g: token_spans(layout, block_ids[g], tokens_from, num_tokens)
        for g, group in enumerate(layout.groups)
        if group.kind == "attention"
    }
    out: list[SectionDigest] = []
    for p in range(src.tp):

        def runs(kind: str, p: int = p) -> list[_Run]:
            if source is None:
                return _own_runs(local_index[kind], p)
            return owners[kind].runs(source_index[kind](spec, src.tp, p))

        for g, group in enumerate(layout.groups):
            if group.kind == "attention":
                if "fa" in sections:
                    out.append(SectionDigest(p, "fa", g, _fa_digest(ranks, group_spans[g], runs("fa"), len(group.layers))))
                continue
            block = int(np.asarray(block_ids[g]).reshape(-1)[0])
            for section in ("conv", "ssm"):
                if section not in sections:
                    continue
                h = xxhash.xxh3_128()
                section_runs = runs(section)
                for region in range(len(group.layers)):
                    for r in section_runs:
                        state = (ranks[r.rank].conv if section == "conv" else ranks[r.rank].ssm)[region][block]
                        h.update(_bytes(state[r.local : r.local + r.length]))
                out.append(SectionDigest(p, section, g, h.digest()))
    return out


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
    heads = [kv_head_index(layout.spec, layout.tp, r) for r in range(layout.tp)]
    out: list[list[SectionDigest]] = [[] for _ in indices]
    for p in range(layout.tp):
        head_runs = _own_runs(heads, p)
        for g, group in enumerate(layout.groups):
            if group.kind != "attention":
                continue
            ids = np.asarray(block_ids[g], dtype=np.int64).reshape(-1)[indices]
            spans = token_spans(layout, ids, 0, ids.size * layout.block_size)
            hashers = [xxhash.xxh3_128() for _ in indices]
            for region in range(len(group.layers)):
                layer = {r.rank: _FaSlabs(ranks[r.rank].fa[region], spans) for r in head_runs}
                for kv in (0, 1):
                    for r in head_runs:
                        data = layer[r.rank].data
                        for head in range(r.local, r.local + r.length):
                            starts, stops = layer[r.rank].slabs(kv, head)
                            for k, h in enumerate(hashers):
                                mine = slice(k * per_block, (k + 1) * per_block)  # block k's kernel blocks
                                for start, stop in zip(starts[mine], stops[mine]):
                                    h.update(data[start:stop])
            for k, h in enumerate(hashers):
                out[k].append(SectionDigest(p, "fa", g, h.digest()))
    return [tuple(d) for d in out]


def _fa_digest(ranks: Sequence[RankViews], spans: Sequence[_TokenSpan], head_runs: Sequence[_Run], num_layers: int) -> bytes:
    """One attention group's K/V for one source rank: layer by layer, K then V, head by head, the
    head's tokens in order, each kernel block's rows hashed where they lie."""
    h = xxhash.xxh3_128()
    update = h.update
    for region in range(num_layers):
        layer = {r.rank: _FaSlabs(ranks[r.rank].fa[region], spans) for r in head_runs}
        for kv in (0, 1):
            for r in head_runs:
                data = layer[r.rank].data
                for head in range(r.local, r.local + r.length):
                    for start, stop in zip(*layer[r.rank].slabs(kv, head)):
                        update(data[start:stop])
    return h.digest()


class _FaSlabs:
    """One layer's K/V on one local rank as host bytes (`data`), and where in them each head's
    rows of the spans' tokens lie: one contiguous slab per kernel block. `data` is the cache
    itself where it is in host memory (nothing copied); a device cache is copied to the host once,
    just the spans' kernel blocks, not slab by slab."""

    def __init__(self, fa: Tensor, spans: Sequence[_TokenSpan]) -> None:
        blocks = np.array([s.block for s in spans], dtype=np.int64)
        raw = fa.view(torch.uint8)  # [kernel block, K|V, head, slot, head_dim bytes]: strides in bytes
        if raw.device.type != "cpu" or not raw.is_contiguous():
            raw = raw.index_select(0, torch.from_numpy(blocks).to(raw.device)).cpu()
            blocks = np.arange(blocks.size, dtype=np.int64)
        self.data = raw.reshape(-1).numpy().data
        # Contiguous: a head's slots in a kernel block are one run of bytes.
        block, self._kv, self._head, slot = raw.stride()[:4]
        self._starts = blocks * block + np.array([s.start for s in spans], dtype=np.int64) * slot
        self._stops = blocks * block + np.array([s.stop for s in spans], dtype=np.int64) * slot

    def slabs(self, kv: int, head: int) -> tuple[list[int], list[int]]:
        """(starts, stops) in `data` of head `head`'s K (kv 0) or V (1) slabs, in token order."""
        at = kv * self._kv + head * self._head
        return (self._starts + at).tolist(), (self._stops + at).tolist()


def compare_digests(
    layout: EngineLayout, expected: Sequence[SectionDigest], got: Sequence[SectionDigest]
) -> list[DigestMismatch]:
    """Every (rank, section, group) whose digests differ, or that only one side has."""
    want = {(d.rank, d.section, d.group): d.digest for d in expected}
    have = {(d.rank, d.section, d.group): d.digest for d in got}
    bad = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    return [DigestMismatch(r, s, g, layout.groups[g].layers) for r, s, g in bad]
