"""The transfer plan for a (prefill layout, decode layout) pair: who reads which bytes from whom.

For every decode rank d the plan lists its source prefill ranks and, per source, one
`ByteRead` (remote offset, local offset, size) for the FA heads, for each conv section and for
the SSM state. The plan is derived from the sharding index functions (`shapes.py`): each
element the decode rank stores (a KV head, a conv channel, an SSM row) is read from the first
candidate source rank that stores it, where the candidates are vLLM's handshake ranks
(`[d // ratio]` for ratio > 0, `[d·a, d·a + a)` for ratio = -a). Consecutive elements form one
contiguous byte range on both sides, so this yields exactly vLLM's 3-read offsets for sections
that shrink with TP (`B_s + ℓ·z_s`, and local split destinations when P_TP > D_TP), the
relative head offset for replicated KV heads, and reads Mamba2 B/C groups replicated across
ranks (TP a multiple of n_groups, n_groups == 1 included) whole from one source per group, at
that group's place in the source's section, where vLLM's proportional offsets misread.

Offsets: FA offsets are inside the K half of an FA unit of `fa_unit_tokens` tokens (the same
offsets apply to the V half). The unit is the gcd of the two kernel block sizes, so every
kernel block of either side is a whole number of units: with equal kernel block sizes the unit
is one kernel block; when one divides the other it is the smaller one; any other pair (for
example 2096 and 1056 tokens, two HMA block sizes of one model at different TP) still works,
with units of gcd tokens (16 here) and more, smaller descriptors. Conv and SSM offsets are
inside the logical page (the conv state starts at 0, the SSM state at `conv_bytes` of that
side).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.layout.compat import layout_issues
from shared.layout.page import EngineLayout
from shared.layout.shapes import conv_channel_index, kv_head_index, ssm_row_index
from shared.layout.spec import LayoutError, ModelSpec

IntArray = npt.NDArray[np.int64]


def tp_ratio(p_tp: int, d_tp: int) -> int:
    """vLLM's sign convention: D_TP / P_TP when D_TP >= P_TP, else -(P_TP / D_TP)."""
    if p_tp < 1 or d_tp < 1:
        raise LayoutError(f"TP sizes must be >= 1, got prefill {p_tp}, decode {d_tp}")
    if d_tp >= p_tp:
        if d_tp % p_tp:
            raise LayoutError(f"decode TP {d_tp} is not a multiple of prefill TP {p_tp}")
        return d_tp // p_tp
    if p_tp % d_tp:
        raise LayoutError(f"prefill TP {p_tp} is not a multiple of decode TP {d_tp}")
    return -(p_tp // d_tp)


def candidate_ranks(p_tp: int, d_tp: int, decode_rank: int) -> tuple[int, ...]:
    """Prefill ranks decode rank `decode_rank` handshakes with (and may read from)."""
    ratio = tp_ratio(p_tp, d_tp)
    if not 0 <= decode_rank < d_tp:
        raise LayoutError(f"decode rank {decode_rank} is outside decode TP {d_tp}")
    if ratio > 0:
        return (decode_rank // ratio,)
    a = -ratio
    return tuple(range(decode_rank * a, decode_rank * a + a))


@dataclass(frozen=True)
class ByteRead:
    remote_offset: int
    local_offset: int
    size: int


@dataclass(frozen=True)
class SourceRead:
    """Everything decode rank d reads from one prefill rank, per layer and block."""

    prefill_rank: int
    fa: ByteRead | None  # inside the K half of an FA unit; the same offsets apply to V
    conv: tuple[ByteRead | None, ...]  # one per conv section, in section order (None: nothing from here)
    ssm: ByteRead | None

    @property
    def mamba_reads(self) -> tuple[ByteRead, ...]:
        """The conv section reads and the SSM read that move bytes, in page order."""
        reads = [c for c in self.conv if c is not None]
        if self.ssm is not None:
            reads.append(self.ssm)
        return tuple(reads)


@dataclass(frozen=True)
class RankPlan:
    decode_rank: int
    candidates: tuple[int, ...]  # handshake ranks
    fa_sources: tuple[int, ...]
    mamba_sources: tuple[int, ...]
    reads: tuple[SourceRead, ...]  # one per source rank, in rank order

    def read_from(self, prefill_rank: int) -> SourceRead:
        for read in self.reads:
            if read.prefill_rank == prefill_rank:
                return read
        raise LayoutError(f"decode rank {self.decode_rank} reads nothing from prefill rank {prefill_rank}")


@dataclass(frozen=True)
class TransferPlan:
    prefill: EngineLayout
    decode: EngineLayout
    tp_ratio: int
    fa_unit_tokens: int  # gcd(prefill kernel block size, decode kernel block size)
    ranks: tuple[RankPlan, ...]  # one per decode rank


def _first_holder(needed: IntArray, holders: list[IntArray]) -> tuple[IntArray, IntArray]:
    """For each needed id: index of the first holder array containing it (-1: none) and its position there."""
    owner = np.full(needed.shape, -1, dtype=np.int64)
    position = np.full(needed.shape, -1, dtype=np.int64)
    for h, held in enumerate(holders):
        order = np.argsort(held, kind="stable")
        ordered = held[order]
        at = np.clip(np.searchsorted(ordered, needed), 0, max(len(held) - 1, 0))
        found = (ordered[at] == needed) & (owner < 0) if len(held) else np.zeros(needed.shape, dtype=bool)
        owner[found] = h
        position[found] = order[at[found]]
    return owner, position


def _run(what: str, local_pos: IntArray, remote_pos: IntArray, unit: int, local_base: int, remote_base: int) -> ByteRead | None:
    """Local positions / remote positions of consecutive elements -> one contiguous ByteRead."""
    if len(local_pos) == 0:
        return None
    if np.any(np.diff(local_pos) != 1) or np.any(np.diff(remote_pos) != 1):
        raise LayoutError(f"{what}: the elements read from one source are not one contiguous range")
    return ByteRead(
        remote_offset=remote_base + int(remote_pos[0]) * unit,
        local_offset=local_base + int(local_pos[0]) * unit,
        size=len(local_pos) * unit,
    )


def _rank_plan(prefill: EngineLayout, decode: EngineLayout, d: int, fa_unit_tokens: int) -> RankPlan:
    spec, ps, ds = decode.spec, prefill.shapes, decode.shapes
    candidates = candidate_ranks(prefill.tp, decode.tp, d)

    def assign(what: str, needed: IntArray, held: list[IntArray]) -> tuple[IntArray, IntArray]:
        owner, position = _first_holder(needed, held)
        if np.any(owner < 0):
            missing = needed[owner < 0][:4].tolist()
            raise LayoutError(f"decode rank {d}: {what} {missing} is held by none of prefill ranks {list(candidates)}")
        return owner, position

    def held(index: Callable[[ModelSpec, int, int], IntArray]) -> tuple[IntArray, list[IntArray]]:
        return index(spec, decode.tp, d), [index(spec, prefill.tp, p) for p in candidates]

    head_owner, head_pos = assign("KV head", *held(kv_head_index))
    chan_owner, chan_pos = assign("conv channel", *held(conv_channel_index))
    row_owner, row_pos = assign("SSM row", *held(ssm_row_index))

    head_unit = fa_unit_tokens * ds.head_dim * ds.kv_dtype_bytes
    section_bounds = np.concatenate([[0], np.cumsum(ds.section_dims)])
    local_rows = np.arange(ds.conv_dim, dtype=np.int64)
    reads: list[SourceRead] = []
    for c, p in enumerate(candidates):
        heads = np.flatnonzero(head_owner == c)
        fa = _run(f"decode rank {d} KV heads from prefill rank {p}", heads, head_pos[heads], head_unit, 0, 0)
        conv: list[ByteRead | None] = []
        for s in range(ds.num_sections):
            in_section = (local_rows >= section_bounds[s]) & (local_rows < section_bounds[s + 1]) & (chan_owner == c)
            rows = np.flatnonzero(in_section)
            what = f"decode rank {d} conv section {ds.section_names[s]} from prefill rank {p}"
            conv.append(_run(what, rows, chan_pos[rows], ds.conv_row_bytes, ds.conv_offset, ps.conv_offset))
        ssm_rows = np.flatnonzero(row_owner == c)
        what = f"decode rank {d} SSM rows from prefill rank {p}"
        ssm = _run(what, ssm_rows, row_pos[ssm_rows], ds.ssm_row_bytes, ds.ssm_offset, ps.ssm_offset)
        if fa is not None or ssm is not None or any(x is not None for x in conv):
            reads.append(SourceRead(prefill_rank=p, fa=fa, conv=tuple(conv), ssm=ssm))
    return RankPlan(
        decode_rank=d,
        candidates=candidates,
        fa_sources=tuple(r.prefill_rank for r in reads if r.fa is not None),
        mamba_sources=tuple(r.prefill_rank for r in reads if r.mamba_reads),
        reads=tuple(reads),
    )


def build_plan(prefill: EngineLayout, decode: EngineLayout) -> TransferPlan:
    """The plan for decode `decode` reading from prefill `prefill`; `LayoutError` when incompatible."""
    issues = layout_issues(prefill, decode)
    if issues:
        raise LayoutError("incompatible layouts: " + "; ".join(i.words for i in issues))
    unit = math.gcd(prefill.kernel_block_size, decode.kernel_block_size)
    return TransferPlan(
        prefill=prefill,
        decode=decode,
        tp_ratio=tp_ratio(prefill.tp, decode.tp),
        fa_unit_tokens=unit,
        ranks=tuple(_rank_plan(prefill, decode, d, unit) for d in range(decode.tp)),
    )
