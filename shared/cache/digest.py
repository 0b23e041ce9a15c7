"""Digests of a request's transferred state: one per (prefill rank, section, layer group).

Prefill takes them right after it wrote the state; decode recomputes them from what its READs
left in its own blocks and compares before its first model step. They prove that decode holds
exactly the bytes prefill wrote, across hosts and hardware, without recomputing anything.

The digested bytes are defined by the model, not by either side's memory: for prefill rank p,
section `fa` of an attention group is, layer by layer, K and V of the request's tokens for the
KV heads p holds, as `[token, K|V, head, head_dim]`; `conv` and `ssm` of a Mamba group are the
conv channels and SSM rows p holds, layer by layer. Who holds what comes from the layout's index
functions, so a decode engine of another TP size or block size gathers the same bytes from its
own ranks (each global index from the lowest local rank holding it) and gets the same digest.
Padding and bytes outside the request are never digested.

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
    return t.contiguous().view(torch.uint8).cpu().numpy().data


def _kernel_blocks(layout: EngineLayout, block_ids: npt.ArrayLike, num_tokens: int) -> Tensor:
    """The kernel blocks holding a request's first `num_tokens` tokens, in token order."""
    needed = -(-num_tokens // layout.kernel_block_size)
    ids = layout.kernel_block_ids(block_ids)
    if ids.size < needed:
        raise IndexError(f"{num_tokens} tokens need {needed} kernel blocks, the request has {ids.size}")
    return torch.from_numpy(ids[:needed])


def _token_major(fa: Tensor, kernel_blocks: Tensor, heads: slice, num_tokens: int) -> Tensor:
    """K/V of heads `heads` for the first `num_tokens` tokens of `kernel_blocks`, as
    [token, K|V, head, head_dim], in one pass: each block is transposed straight into its place
    (indexing token by token, or gathering blocks and then transposing, copies more)."""
    _, kv, _, slots, dim = fa.shape
    out = torch.empty(kernel_blocks.numel(), slots, kv, heads.stop - heads.start, dim, dtype=fa.dtype)
    for i, block in enumerate(kernel_blocks.tolist()):
        out[i].copy_(fa[block, :, heads].permute(2, 0, 1, 3))  # [K|V, head, slot, dim] -> [slot, K|V, head, dim]
    return out.view(-1, kv, heads.stop - heads.start, dim)[:num_tokens]


def state_digests(
    layout: EngineLayout,
    ranks: Sequence[RankViews],
    block_ids: Sequence[npt.ArrayLike],
    num_tokens: int,
    *,
    source: EngineLayout | None = None,
) -> list[SectionDigest]:
    """Digests of one request's state in `ranks` (this engine's, in rank order) for `num_tokens`
    tokens, as the ranks of `source` hold it. `source=None`: this engine is the source, and each
    rank digests its own bytes (prefill); else the bytes are gathered from the local ranks (decode).

    Conv and SSM state are hashed slice by slice where they lie (no copy); K/V are gathered into
    token order first (one copy)."""
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
    out: list[SectionDigest] = []
    for p in range(src.tp):

        def runs(kind: str, p: int = p) -> list[_Run]:
            if source is None:
                return _own_runs(local_index[kind], p)
            return owners[kind].runs(source_index[kind](spec, src.tp, p))

        for g, group in enumerate(layout.groups):
            if group.kind == "attention":
                h = xxhash.xxh3_128()
                kernel_blocks = _kernel_blocks(layout, block_ids[g], num_tokens)
                head_runs = runs("fa")
                for region in range(len(group.layers)):
                    pieces = [
                        _token_major(ranks[r.rank].fa[region], kernel_blocks, slice(r.local, r.local + r.length), num_tokens)
                        for r in head_runs
                    ]
                    h.update(_bytes(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)))
                out.append(SectionDigest(p, "fa", g, h.digest()))
                continue
            block = int(np.asarray(block_ids[g]).reshape(-1)[0])
            for section in ("conv", "ssm"):
                h = xxhash.xxh3_128()
                section_runs = runs(section)
                for region in range(len(group.layers)):
                    for r in section_runs:
                        state = (ranks[r.rank].conv if section == "conv" else ranks[r.rank].ssm)[region][block]
                        h.update(_bytes(state[r.local : r.local + r.length]))
                out.append(SectionDigest(p, section, g, h.digest()))
    return out


def compare_digests(
    layout: EngineLayout, expected: Sequence[SectionDigest], got: Sequence[SectionDigest]
) -> list[DigestMismatch]:
    """Every (rank, section, group) whose digests differ, or that only one side has."""
    want = {(d.rank, d.section, d.group): d.digest for d in expected}
    have = {(d.rank, d.section, d.group): d.digest for d in got}
    bad = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    return [DigestMismatch(r, s, g, layout.groups[g].layers) for r, s, g in bad]
