"""The READs of one request: one per (decode rank, source prefill rank), with their descriptor
lists and the descriptor ids the request picks from them. Pure layout math, done the way the
decode service does it: lists once per peer (`pair_lists`), ids per request (`request_reads`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hybridpd_tools.bench.sections import SectionBytes, section_bytes
from shared.layout.plan import SourceRead, TransferPlan
from shared.layout.read_lists import IdArray, ReadLists, build_read_lists, read_indices

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PairLists:
    decode_rank: int
    prefill_rank: int
    lists: ReadLists
    read: SourceRead


@dataclass(frozen=True)
class PairRead:
    pair: PairLists
    local_idx: IdArray
    remote_idx: IdArray

    @property
    def descriptors(self) -> int:
        return int(self.local_idx.size)

    @property
    def nbytes(self) -> int:
        return int(self.pair.lists.local[self.local_idx, 1].sum())

    def sections(self) -> SectionBytes:
        return section_bytes(self.pair.lists, self.pair.read, self.local_idx.astype(np.int64))


def pair_lists(
    plan: TransferPlan,
    *,
    local_bases: Sequence[IntArray],
    remote_bases: Sequence[IntArray],
    local_num_blocks: int,
    remote_num_blocks: int,
) -> list[PairLists]:
    """Read lists of every (decode rank, prefill rank) pair; `*_bases[rank]`: that rank's region bases."""
    pairs: list[PairLists] = []
    for rank_plan in plan.ranks:
        d = rank_plan.decode_rank
        for read in rank_plan.reads:
            p = read.prefill_rank
            lists = build_read_lists(
                plan,
                d,
                p,
                local_bases=local_bases[d],
                remote_bases=remote_bases[p],
                local_num_blocks=local_num_blocks,
                remote_num_blocks=remote_num_blocks,
            )
            pairs.append(PairLists(d, p, lists, read))
    return pairs


def request_reads(
    pairs: Sequence[PairLists], local_blocks: Sequence[IntArray], remote_blocks: Sequence[IntArray], num_tokens: int
) -> list[PairRead]:
    """The descriptor ids of one request on every pair (pairs with nothing to read are left out)."""
    reads: list[PairRead] = []
    for pair in pairs:
        lidx, ridx = read_indices(pair.lists, local_blocks, remote_blocks, num_tokens)
        if lidx.size:
            reads.append(PairRead(pair, lidx, ridx))
    return reads


def fake_bases(num_ranks: int, num_regions: int, region_bytes: int, side: int) -> list[IntArray]:
    """Made-up, non-overlapping region addresses, for byte and descriptor counts without memory."""
    stride = 1 << max(20, (region_bytes - 1).bit_length())
    return [
        np.array([((side * 64 + r) << 40) + j * stride for j in range(num_regions)], dtype=np.int64) for r in range(num_ranks)
    ]


def total_sections(reads: Sequence[PairRead]) -> SectionBytes:
    total = SectionBytes()
    for r in reads:
        total = total + r.sections()
    return total
