"""Proofs that a transfer plan is right: a byte-interval verifier and a byte-level simulator.

`verify_plan` checks a plan on byte intervals, per decode rank:
- every byte of every local section the decode rank holds (the K and V halves of an FA unit,
  each conv section, the SSM state) is written exactly once, and nothing else is written;
- every remote read stays inside the matching section of a source rank's page (the candidate
  ranks of vLLM's handshake only);
- the elements read are the elements needed: the global KV heads / conv channels / SSM rows at
  the remote range equal those at the local range (through the sharding index functions);
- read totals equal the bytes the decode rank holds.

`simulate_transfer` runs a plan end to end on real bytes: a random global state is sharded into
prefill pages with the index functions, moved with the read lists and `read_indices` (the data
path the transport executes), and unsharded from the decode pages; any difference is reported.
With `layer_parts`, decode reads as a pipelined transfer whose last chunk goes in layer parts:
the K/V before the chunk, then one read per contiguous range of layers (its K/V of the chunk
and its conv/SSM state); every byte must still be written exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.layout.page import EngineLayout
from shared.layout.plan import ByteRead, TransferPlan, candidate_ranks
from shared.layout.read_lists import IdArray, ReadLists, build_read_lists, read_indices
from shared.layout.shapes import (
    conv_channel_index,
    global_conv_dim,
    global_ssm_shape,
    kv_head_index,
    ssm_row_index,
)
from shared.layout.spec import layer_ranges

IntArray = npt.NDArray[np.int64]
Interval = tuple[int, int, int]  # (start, end, source rank)


def _cover_errors(what: str, intervals: list[Interval], lo: int, hi: int) -> list[str]:
    """`intervals` must tile [lo, hi) exactly once."""
    errors: list[str] = []
    at = lo
    for start, end, p in sorted(intervals):
        if end <= start:
            errors.append(f"{what}: empty read from prefill rank {p} at {start}")
            continue
        if start < lo or end > hi:
            errors.append(f"{what}: read [{start}, {end}) from prefill rank {p} writes outside [{lo}, {hi})")
        if start < at:
            errors.append(f"{what}: bytes [{start}, {min(at, end)}) written twice (prefill rank {p})")
        elif start > at:
            errors.append(f"{what}: bytes [{at}, {start}) never written")
        at = max(at, end)
    if at < hi:
        errors.append(f"{what}: bytes [{at}, {hi}) never written")
    return errors


def _element_errors(
    what: str,
    read: ByteRead,
    unit: int,
    local_base: int,
    remote_base: int,
    local_ids: IntArray,
    remote_ids: IntArray,
) -> list[str]:
    """The global ids of the elements read remotely must be those written locally, in order."""
    lo, ro = read.local_offset - local_base, read.remote_offset - remote_base
    if lo % unit or ro % unit or read.size % unit:
        return [f"{what}: offsets/size not multiples of the {unit}-byte element"]
    n = read.size // unit
    local, remote = local_ids[lo // unit : lo // unit + n], remote_ids[ro // unit : ro // unit + n]
    if len(local) != n or len(remote) != n or not np.array_equal(local, remote):
        return [f"{what}: reads elements {remote[:4].tolist()}... into the place of {local[:4].tolist()}..."]
    return []


def _inside(what: str, read: ByteRead, lo: int, hi: int, p: int) -> list[str]:
    start, end = read.remote_offset, read.remote_offset + read.size
    if start < lo or end > hi:
        return [f"{what}: remote read [{start}, {end}) on prefill rank {p} leaves its section [{lo}, {hi})"]
    return []


def verify_plan(plan: TransferPlan) -> list[str]:
    """Every violation of the plan (empty when it is right)."""
    pre, dec = plan.prefill, plan.decode
    ps, ds = pre.shapes, dec.shapes
    spec = dec.spec
    errors: list[str] = []
    if len(plan.ranks) != dec.tp:
        errors.append(f"plan has {len(plan.ranks)} decode ranks, decode TP is {dec.tp}")
    unit_tokens = plan.fa_unit_tokens
    if pre.kernel_block_size % unit_tokens or dec.kernel_block_size % unit_tokens:
        errors.append(f"FA unit {unit_tokens} tokens does not divide both kernel block sizes")
    head_unit = unit_tokens * ds.head_dim * ds.kv_dtype_bytes
    p_sections = list(zip(ps.piece_offsets[:-1], ps.section_bytes))
    for d, rank in enumerate(plan.ranks):
        tag = f"decode rank {d}"
        if rank.decode_rank != d:
            errors.append(f"{tag}: listed as decode rank {rank.decode_rank}")
            continue
        allowed = set(candidate_ranks(pre.tp, dec.tp, d))
        seen: set[int] = set()
        fa: list[Interval] = []
        conv: list[list[Interval]] = [[] for _ in range(ds.num_sections)]
        ssm: list[Interval] = []
        total = 0
        local_heads, local_chans, local_rows = (
            kv_head_index(spec, dec.tp, d),
            conv_channel_index(spec, dec.tp, d),
            ssm_row_index(spec, dec.tp, d),
        )
        for read in rank.reads:
            p = read.prefill_rank
            if p not in allowed or p in seen:
                errors.append(f"{tag}: reads from prefill rank {p} (allowed once each: {sorted(allowed)})")
                continue
            seen.add(p)
            if read.fa is not None:
                what = f"{tag} FA from prefill rank {p}"
                fa.append((read.fa.local_offset, read.fa.local_offset + read.fa.size, p))
                errors += _inside(what, read.fa, 0, ps.kv_heads_per_rank * head_unit, p)
                errors += _element_errors(what, read.fa, head_unit, 0, 0, local_heads, kv_head_index(spec, pre.tp, p))
                total += 2 * read.fa.size
            if len(read.conv) != ds.num_sections:
                errors.append(f"{tag}: {len(read.conv)} conv reads from prefill rank {p}, {ds.num_sections} sections")
                continue
            remote_chans = conv_channel_index(spec, pre.tp, p)
            for s, c in enumerate(read.conv):
                if c is None:
                    continue
                what = f"{tag} conv section {ds.section_names[s]} from prefill rank {p}"
                conv[s].append((c.local_offset, c.local_offset + c.size, p))
                errors += _inside(what, c, p_sections[s][0], p_sections[s][0] + p_sections[s][1], p)
                errors += _element_errors(what, c, ds.conv_row_bytes, 0, 0, local_chans, remote_chans)
                total += c.size
            if read.ssm is not None:
                what = f"{tag} SSM from prefill rank {p}"
                ssm.append((read.ssm.local_offset, read.ssm.local_offset + read.ssm.size, p))
                errors += _inside(what, read.ssm, ps.ssm_offset, ps.ssm_offset + ps.ssm_bytes, p)
                remote_rows = ssm_row_index(spec, pre.tp, p)
                errors += _element_errors(what, read.ssm, ds.ssm_row_bytes, ds.ssm_offset, ps.ssm_offset, local_rows, remote_rows)
                total += read.ssm.size
        errors += _cover_errors(f"{tag} FA K/V half", fa, 0, ds.kv_heads_per_rank * head_unit)
        for s in range(ds.num_sections):
            lo = ds.piece_offsets[s]
            errors += _cover_errors(f"{tag} conv section {ds.section_names[s]}", conv[s], lo, lo + ds.section_bytes[s])
        errors += _cover_errors(f"{tag} SSM state", ssm, ds.ssm_offset, ds.ssm_offset + ds.ssm_bytes)
        held = 2 * ds.kv_heads_per_rank * head_unit + ds.mamba_bytes
        if total != held:
            errors.append(f"{tag}: reads total {total} bytes per FA unit + Mamba page, the rank holds {held}")
    return errors


# --- byte-level simulation ------------------------------------------------------------------


@dataclass
class _Rank:
    """One simulated rank: all regions in one byte arena starting at address `base`."""

    layout: EngineLayout
    num_blocks: int
    base: int
    memory: npt.NDArray[np.uint8]

    def region_base(self, j: int) -> int:
        return self.base + j * self.layout.region_bytes(self.num_blocks)

    def region(self, j: int) -> npt.NDArray[np.uint8]:
        size = self.layout.region_bytes(self.num_blocks)
        return self.memory[j * size : (j + 1) * size]

    def fa_view(self, j: int) -> npt.NDArray[np.uint8]:
        lay, s = self.layout, self.layout.shapes
        blocks = self.num_blocks * lay.physical_per_logical
        return self.region(j).reshape(blocks, 2, s.kv_heads_per_rank, lay.kernel_block_size, lay.fa_token_bytes)

    def pages(self, j: int) -> npt.NDArray[np.uint8]:
        return self.region(j).reshape(self.num_blocks, self.layout.page_bytes)


def _allocate(
    rng: np.random.Generator, layout: EngineLayout, num_tokens: int, spare: int, contiguous: bool
) -> tuple[int, list[IntArray]]:
    """Block ids per group for one request (disjoint across groups) and the pool size."""
    fa_blocks = max(1, -(-num_tokens // layout.block_size))
    counts = [fa_blocks if g.kind == "attention" else 1 for g in layout.groups]
    total = sum(counts) + spare
    if contiguous:
        start = int(rng.integers(0, spare + 1))
        pool = np.arange(start, start + sum(counts), dtype=np.int64)
    else:
        pool = rng.permutation(total).astype(np.int64)
    cuts = np.cumsum([0, *counts])
    return total, [pool[cuts[i] : cuts[i + 1]] for i in range(len(counts))]


def _token_slots(layout: EngineLayout, ids: IntArray, num_tokens: int) -> tuple[IntArray, IntArray]:
    """(kernel block, token in kernel block) of each token position."""
    t = np.arange(num_tokens, dtype=np.int64)
    logical = ids[t // layout.block_size]
    in_block = t % layout.block_size
    kernel = logical * layout.physical_per_logical + in_block // layout.kernel_block_size
    return kernel, in_block % layout.kernel_block_size


def last_chunk_start(num_tokens: int, fa_unit_tokens: int) -> int:
    """Where the simulated pipelined transfer's last chunk starts: the prompt's second half, from
    an FA unit boundary (a part's `tokens_from` must be one), so short prompts have a first part."""
    return num_tokens // 2 // fa_unit_tokens * fa_unit_tokens


def _read_parts(
    plan: TransferPlan,
    lists: ReadLists,
    local_ids: list[IntArray],
    remote_ids: list[IntArray],
    num_tokens: int,
    layer_parts: int,
) -> list[tuple[IdArray, IdArray]]:
    """The (local, remote) ids of each READ of one (decode, source) pair: the whole request at
    once, or with `layer_parts` the parts of a pipelined transfer: the K/V of the tokens before
    the last chunk, then the last chunk one layer range at a time, each with its conv/SSM state."""
    if not layer_parts:
        return [read_indices(lists, local_ids, remote_ids, num_tokens)]
    start = last_chunk_start(num_tokens, plan.fa_unit_tokens)
    before = read_indices(lists, local_ids, remote_ids, start, mamba=False)
    return [before] + [
        read_indices(lists, local_ids, remote_ids, num_tokens, tokens_from=start, layers=layers)
        for layers in layer_ranges(plan.decode.spec.num_layers, layer_parts)
    ]


def simulate_transfer(
    plan: TransferPlan,
    *,
    num_tokens: int,
    seed: int = 0,
    spare_blocks: int = 2,
    contiguous: bool = False,
    layer_parts: int = 0,
) -> list[str]:
    """Move a random request's state through `plan` on simulated memory; list every mismatch.

    `layer_parts` > 0: read it in parts, as a pipelined transfer does (`_read_parts`)."""
    rng = np.random.default_rng(seed)
    pre, dec = plan.prefill, plan.decode
    spec = dec.spec
    kvb, convb, ssmb = pre.shapes.kv_dtype_bytes, pre.shapes.conv_dtype_bytes, pre.shapes.ssm_dtype_bytes
    kv = spec.attention
    n_fa_layers = len(spec.attention_layers)
    n_ssm_layers = len(spec.ssm_layers)
    # Global state: raw bytes, element bytes last.
    g_kv = rng.integers(0, 256, (n_fa_layers, num_tokens, 2, kv.num_kv_heads, kv.head_dim * kvb), dtype=np.uint8)
    g_conv = rng.integers(0, 256, (n_ssm_layers, global_conv_dim(spec), pre.shapes.conv_rows * convb), dtype=np.uint8)
    ssm_shape = global_ssm_shape(spec)
    g_ssm = rng.integers(0, 256, (n_ssm_layers, ssm_shape[0], int(np.prod(ssm_shape[1:])) * ssmb), dtype=np.uint8)
    fa_index = {layer: i for i, layer in enumerate(spec.attention_layers)}
    ssm_index = {layer: i for i, layer in enumerate(spec.ssm_layers)}

    def make_ranks(layout: EngineLayout, ids_seed: int, arena: int) -> tuple[list[_Rank], list[IntArray]]:
        n_blocks, ids = _allocate(np.random.default_rng(ids_seed), layout, num_tokens, spare_blocks, contiguous)
        size = layout.num_regions * layout.region_bytes(n_blocks)
        ranks = [
            _Rank(layout, n_blocks, arena + r * (size + 4096), rng.integers(0, 256, size, dtype=np.uint8))
            for r in range(layout.tp)
        ]
        return ranks, ids

    p_ranks, p_ids = make_ranks(pre, seed + 1, 1 << 20)
    d_ranks, d_ids = make_ranks(dec, seed + 2, 1 << 32)

    # Prefill writes every rank's shard (the engine's job).
    for r, rank in enumerate(p_ranks):
        heads = kv_head_index(spec, pre.tp, r)
        chans, rows = conv_channel_index(spec, pre.tp, r), ssm_row_index(spec, pre.tp, r)
        for g, group in enumerate(pre.groups):
            for j, layer in enumerate(group.layers):
                if group.kind == "attention":
                    kernel, tok = _token_slots(pre, p_ids[g], num_tokens)
                    view, local_heads = rank.fa_view(j), np.arange(len(heads))[None, :]
                    for half in (0, 1):
                        kv_half = g_kv[fa_index[layer], :, half][:, heads]
                        view[kernel[:, None], half, local_heads, tok[:, None]] = kv_half
                else:
                    page = rank.pages(j)[p_ids[g][0]]
                    s = pre.shapes
                    page[s.conv_offset : s.conv_offset + s.conv_bytes] = g_conv[ssm_index[layer]][chans].reshape(-1)
                    page[s.ssm_offset : s.ssm_offset + s.ssm_bytes] = g_ssm[ssm_index[layer]][rows].reshape(-1)

    # Decode reads: one READ per (decode rank, source rank), executed as byte copies.
    errors: list[str] = []
    written = [np.zeros(len(r.memory), dtype=np.int32) for r in d_ranks]
    for d, rank_plan in enumerate(plan.ranks):
        dst = d_ranks[d]
        for read in rank_plan.reads:
            src = p_ranks[read.prefill_rank]
            lists = build_read_lists(
                plan,
                d,
                read.prefill_rank,
                local_bases=[dst.region_base(j) for j in range(dec.num_regions)],
                remote_bases=[src.region_base(j) for j in range(pre.num_regions)],
                local_num_blocks=dst.num_blocks,
                remote_num_blocks=src.num_blocks,
            )
            pair = f"decode rank {d} <- prefill rank {read.prefill_rank}"
            for li, ri in _read_parts(plan, lists, d_ids, p_ids, num_tokens, layer_parts):
                if len(li) != len(ri):
                    errors.append(f"{pair}: {len(li)} local vs {len(ri)} remote ids")
                    continue
                local, remote = lists.local[li], lists.remote[ri]
                if np.any(local[:, 1] != remote[:, 1]):
                    errors.append(f"{pair}: paired descriptors differ in length")
                    continue
                for (la, n), (ra, _) in zip(local.tolist(), remote.tolist()):
                    lo, ro = la - dst.base, ra - src.base
                    if lo < 0 or lo + n > len(dst.memory) or ro < 0 or ro + n > len(src.memory):
                        errors.append(f"{pair}: descriptor outside registered memory")
                        continue
                    dst.memory[lo : lo + n] = src.memory[ro : ro + n]
                    written[d][lo : lo + n] += 1

    for d, w in enumerate(written):
        if int(w.max(initial=0)) > 1:
            errors.append(f"decode rank {d}: {int(np.count_nonzero(w > 1))} bytes written more than once")
        for j in range(dec.num_regions):
            size = dec.region_bytes(d_ranks[d].num_blocks)
            pad = w[j * size : (j + 1) * size].reshape(d_ranks[d].num_blocks, dec.page_bytes)[:, dec.mamba_bytes :]
            for g, group in enumerate(dec.groups):
                if group.kind == "mamba" and j < len(group.layers) and np.any(pad[d_ids[g][0]]):
                    errors.append(f"decode rank {d} region {j}: Mamba page padding written")

    # Unshard the decode side and compare with the global state.
    for d, rank in enumerate(d_ranks):
        heads = kv_head_index(spec, dec.tp, d)
        chans, rows = conv_channel_index(spec, dec.tp, d), ssm_row_index(spec, dec.tp, d)
        s = dec.shapes
        for g, group in enumerate(dec.groups):
            for j, layer in enumerate(group.layers):
                if group.kind == "attention":
                    kernel, tok = _token_slots(dec, d_ids[g], num_tokens)
                    view = rank.fa_view(j)
                    for half in (0, 1):
                        got = view[kernel[:, None], half, np.arange(len(heads))[None, :], tok[:, None]]
                        if not np.array_equal(got, g_kv[fa_index[layer], :, half][:, heads]):
                            errors.append(f"decode rank {d} layer {layer}: {'KV'[half]} cache differs from prefill")
                else:
                    page = rank.pages(j)[d_ids[g][0]]
                    conv, ssm = g_conv[ssm_index[layer]][chans], g_ssm[ssm_index[layer]][rows]
                    if not np.array_equal(page[s.conv_offset : s.conv_offset + s.conv_bytes], conv.reshape(-1)):
                        errors.append(f"decode rank {d} layer {layer}: conv state differs from prefill")
                    if not np.array_equal(page[s.ssm_offset : s.ssm_offset + s.ssm_bytes], ssm.reshape(-1)):
                        errors.append(f"decode rank {d} layer {layer}: SSM state differs from prefill")
    return errors
