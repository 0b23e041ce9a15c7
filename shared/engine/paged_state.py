"""One request's state in the paged, TP-sharded caches of an engine's ranks.

Engines compute on GLOBAL (unsharded) tensors; this store scatters them into every rank's
shard on write and gathers them back on read, with the layout's index functions as the only
definition of who holds what. Replicated pieces (KV heads when TP > KV heads, Mamba2 B/C groups
when TP > n_groups) are written to every holder and read from the lowest rank holding them;
`replica_mismatches` says whether the copies agree.

Implements the reference engine's `StateStore` protocol, plus range writes for engines that
fill many positions at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from shared.cache.model_views import RankViews
from shared.engine.protocol import RequestBlocks
from shared.layout.page import EngineLayout
from shared.layout.shapes import conv_channel_index, global_conv_dim, global_ssm_shape, kv_head_index, ssm_row_index


class PagedStateStore:
    def __init__(self, layout: EngineLayout, ranks: Sequence[RankViews], blocks: RequestBlocks) -> None:
        if len(ranks) != layout.tp:
            raise ValueError(f"need one cache per rank: {len(ranks)} caches for TP {layout.tp}")
        self.layout = layout
        self.ranks = list(ranks)
        self.blocks = blocks
        spec, tp = layout.spec, layout.tp
        self._kv_heads = [torch.from_numpy(kv_head_index(spec, tp, r)) for r in range(tp)]
        self._conv_rows = [torch.from_numpy(conv_channel_index(spec, tp, r)) for r in range(tp)]
        self._ssm_rows = [torch.from_numpy(ssm_row_index(spec, tp, r)) for r in range(tp)]
        self._conv_shape = (global_conv_dim(spec), layout.shapes.conv_rows)
        self._ssm_shape = global_ssm_shape(spec)
        # One rank holding every conv channel and SSM row in the global order: its pages are the
        # global state as they are.
        self._whole_pages = tp == 1 and all(
            bool(torch.equal(rows, torch.arange(len(rows)))) for rows in (self._conv_rows[0], self._ssm_rows[0])
        )
        # One rank holding every KV head in order: its kernel blocks' tokens are K/V as they are.
        self._whole_kv = tp == 1 and bool(torch.equal(self._kv_heads[0], torch.arange(len(self._kv_heads[0]))))
        device = ranks[0].cache.device
        self._device = device

    # --- attention ----------------------------------------------------------------------
    def _token_slots(self, layer: int, positions: np.ndarray) -> tuple[int, Tensor, Tensor]:
        """(region, kernel block id, slot in kernel block) of each token position."""
        lay = self.layout
        group = lay.group_of("attention", layer)
        try:
            kernel, slot = lay.token_slots(self.blocks.block_ids[group], positions)
        except IndexError as e:
            raise IndexError(f"request {self.blocks.request_id}, group {group}: {e}") from None
        return lay.region_of("attention", layer), torch.from_numpy(kernel), torch.from_numpy(slot)

    def write_kv_range(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Store K and V (`[T, num_kv_heads, head_dim]`) of positions start..start+T-1."""
        region, kernel, slot = self._token_slots(layer, np.arange(start, start + k.shape[0]))
        for rank, heads in zip(self.ranks, self._kv_heads):
            fa = rank.fa[region]
            # [T, heads_r, hd] -> fa[kernel, half, :, slot, :] (advanced dims first).
            # .to(device): with TP > 1 on GPUs rank r's cache lives on cuda:r.
            fa[kernel, 0, :, slot, :] = k[:, heads].to(fa.device, fa.dtype)
            fa[kernel, 1, :, slot, :] = v[:, heads].to(fa.device, fa.dtype)

    def write_kv(self, layer: int, pos: int, k: Tensor, v: Tensor) -> None:
        self.write_kv_range(layer, pos, k.unsqueeze(0), v.unsqueeze(0))

    def read_kv(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        spec = self.layout.spec
        region, kernel, slot = self._token_slots(layer, np.arange(length))
        shape = (length, spec.attention.num_kv_heads, spec.attention.head_dim)
        out_k = torch.empty(shape, dtype=torch.float32, device=self._device)
        out_v = torch.empty(shape, dtype=torch.float32, device=self._device)
        # Reverse rank order: the lowest rank holding a replicated head wins.
        for rank, heads in reversed(list(zip(self.ranks, self._kv_heads))):
            fa = rank.fa[region]
            out_k[:, heads] = fa[kernel, 0, :, slot, :].to(self._device, torch.float32)
            out_v[:, heads] = fa[kernel, 1, :, slot, :].to(self._device, torch.float32)
        return out_k, out_v

    def read_kv_as(self, layer: int, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """`read_kv` straight into `dtype` (exact when it is the stored dtype or wider)."""
        ((k, v),) = read_kv_many([self], layer, [length], dtype)
        return k, v

    # --- SSM ----------------------------------------------------------------------------
    def _mamba_block(self, layer: int) -> tuple[int, int]:
        lay = self.layout
        group = lay.group_of("mamba", layer)
        ids = np.asarray(self.blocks.block_ids[group], dtype=np.int64)
        if ids.size != 1:
            raise ValueError(f"request {self.blocks.request_id}: mamba group {group} has {ids.size} blocks, expected 1")
        return lay.region_of("mamba", layer), int(ids[0])

    def read_ssm(self, layer: int) -> tuple[Tensor, Tensor]:
        region, block = self._mamba_block(layer)
        conv = torch.empty(self._conv_shape, dtype=torch.float32, device=self._device)
        ssm = torch.empty(self._ssm_shape, dtype=torch.float32, device=self._device)
        for rank, crow, srow in reversed(list(zip(self.ranks, self._conv_rows, self._ssm_rows))):
            conv[crow] = rank.conv[region][block].to(self._device, torch.float32)
            ssm[srow] = rank.ssm[region][block].to(self._device, torch.float32)
        return conv, ssm

    def reset_ssm(self) -> None:
        """Zero every SSM layer's conv and SSM state on every rank (a new request)."""
        for layer in self.layout.spec.ssm_layers:
            region, block = self._mamba_block(layer)
            for rank in self.ranks:
                rank.conv[region][block].zero_()
                rank.ssm[region][block].zero_()

    def write_ssm(self, layer: int, conv: Tensor, ssm: Tensor) -> None:
        region, block = self._mamba_block(layer)
        for rank, crow, srow in zip(self.ranks, self._conv_rows, self._ssm_rows):
            dst_conv, dst_ssm = rank.conv[region][block], rank.ssm[region][block]
            dst_conv.copy_(conv[crow])
            dst_ssm.copy_(ssm[srow])

    # --- checks -------------------------------------------------------------------------
    def replica_mismatches(self, length: int) -> list[str]:
        """Replicated pieces whose copies differ between ranks (empty when all agree).

        Every rank's shard is compared with the unsharded state read back (which takes each
        replicated piece from the lowest rank holding it), so one vectorised comparison per rank
        and layer covers every copy."""
        problems: list[str] = []
        spec = self.layout.spec
        for layer in spec.attention_layers if length else ():
            region, kernel, slot = self._token_slots(layer, np.arange(length))
            k, v = self.read_kv(layer, length)
            for r, (rank, heads) in enumerate(zip(self.ranks, self._kv_heads)):
                fa = rank.fa[region]
                same_k = fa[kernel, 0, :, slot, :].to(torch.float32) == k[:, heads]
                same_v = fa[kernel, 1, :, slot, :].to(torch.float32) == v[:, heads]
                bad = heads[~(same_k & same_v).reshape(length, len(heads), -1).all(dim=2).all(dim=0)]
                problems += [f"layer {layer}: KV head {int(h)} differs on rank {r}" for h in bad]
        for layer in spec.ssm_layers:
            region, block = self._mamba_block(layer)
            conv, _ = self.read_ssm(layer)
            for r, (rank, crow) in enumerate(zip(self.ranks, self._conv_rows)):
                bad = crow[~(rank.conv[region][block].to(torch.float32) == conv[crow]).all(dim=1)]
                if bad.numel():
                    problems.append(f"layer {layer}: conv channel {int(bad[0])} differs on rank {r}")
        return problems


# --- many requests at once (batched decode) -------------------------------------------------
# One indexing op per rank and layer for every request of a step: the stores share one layout
# and one set of ranks (the first store's index maps serve all).


class StepIndex:
    """The block-table lookups of one batched step, made once per KV-cache group and kept for
    every other layer of the group (the layers of a group share their block ids)."""

    def __init__(self) -> None:
        self.kv: dict[tuple[str, int], tuple[Tensor, Tensor]] = {}
        self.mamba: dict[int, Tensor] = {}
        self.rows: dict[tuple[str, int], tuple[Tensor, list[int]]] = {}
        self.tables: dict[int, Tensor] = {}


def _kv_slots(
    stores: Sequence[PagedStateStore],
    layer: int,
    positions: Sequence[np.ndarray],
    index: StepIndex | None = None,
    use: str = "",
) -> tuple[int, Tensor, Tensor]:
    """(region, kernel block ids, slots) of `positions[b]` of every request b; with `index`,
    looked up once per group and `use` (what the positions are: they must be the same for every
    layer that names that use)."""
    lay = stores[0].layout
    region = lay.region_of("attention", layer)
    key = (use, lay.group_of("attention", layer))
    if index is not None and key in index.kv:
        return region, *index.kv[key]
    kernels, slots = [], []
    for store, pos in zip(stores, positions):
        _, kernel, slot = store._token_slots(layer, pos)
        kernels.append(kernel)
        slots.append(slot)
    found = torch.cat(kernels), torch.cat(slots)
    if index is not None:
        index.kv[key] = found
    return region, *found


def write_kv_tokens(
    stores: Sequence[PagedStateStore],
    layer: int,
    positions: Sequence[int],
    k: Tensor,
    v: Tensor,
    index: StepIndex | None = None,
) -> None:
    """Store K and V (`[B, kv_heads, head_dim]`, row b for request b) of one token per request,
    request b's at position `positions[b]`."""
    if not stores:
        return
    first = stores[0]
    if first._whole_kv:  # one rank, every head in order: K and V of every request in one copy
        lay = first.layout
        fa = first.ranks[0].fa[lay.region_of("attention", layer)]
        key = ("new token", lay.group_of("attention", layer))
        if index is not None and key in index.rows:
            rows = index.rows[key][0]
        else:
            kernel, slot = _kernel_slots(stores, layer, np.arange(len(stores)), np.asarray(positions, dtype=np.int64))
            rows = torch.from_numpy((_fa_row(fa, kernel, slot)[:, None] + _head_rows(fa)[None, :]).reshape(-1))
            if index is not None:
                index.rows[key] = rows, []
        new = torch.stack([k, v], dim=1).reshape(-1, fa.shape[-1])  # [B * 2 * heads, hd]: K heads, then V heads
        fa.view(-1, fa.shape[-1]).index_copy_(0, rows.to(fa.device), new.to(fa.device, fa.dtype))
        return
    region, kernel_ids, slots = _kv_slots(stores, layer, [np.array([p]) for p in positions], index, "new token")
    for rank, heads in zip(first.ranks, first._kv_heads):
        fa = rank.fa[region]
        fa[kernel_ids, 0, :, slots, :] = k[:, heads].to(fa.device, fa.dtype)
        fa[kernel_ids, 1, :, slots, :] = v[:, heads].to(fa.device, fa.dtype)


def _kv_blocks(
    stores: Sequence[PagedStateStore], layer: int, lengths: Sequence[int], index: StepIndex | None
) -> tuple[int, Tensor, Tensor]:
    """(region, the kernel blocks holding positions 0..lengths[b]-1 of every request b, in
    order, and the rows of those tokens in the blocks' tokens laid end to end)."""
    lay = stores[0].layout
    region = lay.region_of("attention", layer)
    group = lay.group_of("attention", layer)
    key = ("blocks", group)
    if index is not None and key in index.kv:
        return region, *index.kv[key]
    kb = lay.kernel_block_size
    blocks, rows, first_row = [], [], 0
    for store, n in zip(stores, lengths):
        ids = np.asarray(store.blocks.block_ids[group], dtype=np.int64)
        needed = -(-n // kb)
        kernel = lay.kernel_block_ids(ids)
        if kernel.size < needed:
            raise IndexError(f"request {store.blocks.request_id}, group {group}: {n} tokens need {needed} kernel blocks")
        blocks.append(kernel[:needed])
        rows.append(np.arange(first_row, first_row + n, dtype=np.int64))
        first_row += needed * kb
    found = torch.from_numpy(np.concatenate(blocks)), torch.from_numpy(np.concatenate(rows))
    if index is not None:
        index.kv[key] = found
    return region, *found


def read_kv_many(
    stores: Sequence[PagedStateStore],
    layer: int,
    lengths: Sequence[int],
    dtype: torch.dtype,
    index: StepIndex | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """K and V of positions 0..lengths[b]-1 of every request b (`[T_b, kv_heads, head_dim]`, in
    `dtype`): whole kernel blocks gathered in one copy per rank, then the tokens picked out."""
    if not stores:
        return []
    first = stores[0]
    spec = first.layout.spec
    region, blocks, rows = _kv_blocks(stores, layer, lengths, index)
    if first._whole_kv:
        return _whole_kv(first, region, blocks, lengths, dtype)
    total = int(rows.shape[0])
    shape = (total, 2, spec.attention.num_kv_heads, spec.attention.head_dim)
    out = torch.empty(shape, dtype=dtype, device=first._device)
    for rank, heads in reversed(list(zip(first.ranks, first._kv_heads))):
        fa = rank.fa[region]  # [kernel blocks, 2, heads_r, kb, hd]
        got = fa.index_select(0, blocks.to(fa.device)).to(first._device, dtype)
        tokens = got.permute(0, 3, 1, 2, 4).reshape(-1, *got.shape[1:3], got.shape[4])  # [blocks * kb, 2, heads_r, hd]
        out[:, :, heads] = tokens.index_select(0, rows.to(first._device))
    parts = torch.split(out, list(lengths))
    return [(p[:, 0], p[:, 1]) for p in parts]


def _kernel_slots(
    stores: Sequence[PagedStateStore], layer: int, request: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(kernel block id, slot) of token `pos[i]` of request `request[i]` (`EngineLayout.token_slots`
    for many requests at once). IndexError naming the request when a position has no block."""
    lay = stores[0].layout
    group = lay.group_of("attention", layer)
    tables = [np.asarray(s.blocks.block_ids[group], dtype=np.int64) for s in stores]
    counts = np.array([t.size for t in tables], dtype=np.int64)
    table = np.zeros((len(stores), max(1, int(counts.max(initial=0)))), dtype=np.int64)
    for b, t in enumerate(tables):
        table[b, : t.size] = t
    logical = pos // lay.block_size
    short = logical >= counts[request]
    if short.any():
        first = int(np.argmax(short))
        b, p = int(request[first]), int(pos[first])
        raise IndexError(
            f"request {stores[b].blocks.request_id}, group {group}: position {p} needs {p // lay.block_size + 1} blocks, "
            f"the request has {int(counts[b])}"
        )
    within = pos % lay.block_size
    kernel = table[request, logical] * lay.physical_per_logical + within // lay.kernel_block_size
    return kernel, within % lay.kernel_block_size


def _fa_row(fa: Tensor, kernel: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """Row, in `fa` seen as `[-1, head_dim]` rows (`fa`: [kernel blocks, 2, heads, kb, hd],
    contiguous), of the first head's K at (kernel block, slot)."""
    _, _, heads, kb, _ = fa.shape
    rows: np.ndarray = kernel * (2 * heads * kb) + slot
    return rows


def _head_rows(fa: Tensor) -> np.ndarray:
    """What each of K's heads, then each of V's, adds to `_fa_row`."""
    _, _, heads, kb, _ = fa.shape
    return np.arange(2 * heads, dtype=np.int64) * kb


def read_kv_heads(
    stores: Sequence[PagedStateStore],
    layer: int,
    lengths: Sequence[int],
    dtype: torch.dtype,
    index: StepIndex | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """K and V of positions 0..lengths[b]-1 of every request b, head-major (`[kv_heads, T_b,
    head_dim]`, in `dtype`): what a decode step's attention multiplies by, with no copy per request.

    At TP 1 one gather of token rows lays every request's K then V out in its own span, which
    starts on a 64-byte boundary: a request's tensors have the same strides and alignment
    whatever the other requests (a GEMM's rounding may depend on alignment). Elsewhere the
    general read, transposed."""
    if not stores:
        return []
    first = stores[0]
    if not first._whole_kv:
        return [(k.transpose(0, 1), v.transpose(0, 1)) for k, v in read_kv_many(stores, layer, lengths, dtype, index)]
    lay = first.layout
    fa = first.ranks[0].fa[lay.region_of("attention", layer)]  # [kernel blocks, 2, heads, kb, hd]
    heads, hd = fa.shape[2], fa.shape[4]
    key = ("rows", lay.group_of("attention", layer))
    if index is not None and key in index.rows:
        rows, starts = index.rows[key]
    else:
        rows, starts = _span_rows(stores, layer, fa, np.asarray(lengths, dtype=np.int64), dtype)
        if index is not None:
            index.rows[key] = rows, starts
    got = fa.view(-1, hd).index_select(0, rows.to(fa.device)).to(first._device, dtype)
    out = []
    for at, n in zip(starts, lengths):
        span = got[at : at + 2 * heads * n].view(2, heads, n, hd)
        out.append((span[0], span[1]))
    return out


def _span_rows(
    stores: Sequence[PagedStateStore], layer: int, fa: Tensor, lengths: np.ndarray, dtype: torch.dtype
) -> tuple[Tensor, list[int]]:
    """The `fa` rows `read_kv_heads` gathers, and where each request's span starts: request b's
    span is [2 * heads, lengths[b]] rows (K's heads, then V's, each its tokens in order)."""
    hd = fa.shape[4]
    align = 64 // math.gcd(64, hd * torch.empty((), dtype=dtype).element_size())  # rows per 64 bytes
    spans = len(_head_rows(fa)) * lengths
    padded = -(-spans // align) * align
    starts = np.cumsum(padded) - padded
    request = np.repeat(np.arange(len(stores)), lengths)
    firsts = np.cumsum(lengths) - lengths
    token = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(firsts, lengths)
    kernel, slot = _kernel_slots(stores, layer, request, token)
    hh = np.arange(len(_head_rows(fa)), dtype=np.int64)[:, None]
    dest = starts[request][None, :] + hh * lengths[request][None, :] + token[None, :]
    rows = np.zeros(int(padded.sum()), dtype=np.int64)  # the padding reads row 0, never used
    rows[dest.reshape(-1)] = (_fa_row(fa, kernel, slot)[None, :] + _head_rows(fa)[:, None]).reshape(-1)
    return torch.from_numpy(rows), [int(a) for a in starts]


def _whole_kv(
    first: PagedStateStore, region: int, blocks: Tensor, lengths: Sequence[int], dtype: torch.dtype
) -> list[tuple[Tensor, Tensor]]:
    """`read_kv_many` where one rank holds every head: the kernel blocks gathered and laid out
    as tokens in one copy; each request's tokens are then a slice of them (its blocks follow the
    previous request's), not a second gather."""
    fa = first.ranks[0].fa[region]  # [kernel blocks, 2, heads, kb, hd]
    got = fa.index_select(0, blocks.to(fa.device))
    kb = got.shape[3]
    tokens = got.permute(0, 3, 1, 2, 4).reshape(-1, 2, got.shape[2], got.shape[4]).to(first._device, dtype)
    out, row = [], 0
    for n in lengths:
        part = tokens[row : row + n]
        out.append((part[:, 0], part[:, 1]))
        row += -(-n // kb) * kb
    return out


def _mamba_blocks(stores: Sequence[PagedStateStore], layer: int, index: StepIndex | None = None) -> tuple[int, Tensor]:
    lay = stores[0].layout
    region, group = lay.region_of("mamba", layer), lay.group_of("mamba", layer)
    if index is not None and group in index.mamba:
        return region, index.mamba[group]
    ids = torch.tensor([store._mamba_block(layer)[1] for store in stores], dtype=torch.long)
    if index is not None:
        index.mamba[group] = ids
    return region, ids


def read_ssm_many(
    stores: Sequence[PagedStateStore],
    layer: int,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
    index: StepIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """Every request's conv `[B, C, K-1]` and SSM state `[B, *ssm_shape]`, in the given dtypes."""
    first = stores[0]
    region, ids = _mamba_blocks(stores, layer, index)
    if first._whole_pages:  # one rank holds every row in order: a plain gather of the requests' pages
        rank = first.ranks[0]
        conv_all, ssm_all = rank.conv[region], rank.ssm[region]
        return (
            conv_all.index_select(0, ids.to(conv_all.device)).to(first._device, conv_dtype),
            ssm_all.index_select(0, ids.to(ssm_all.device)).to(first._device, ssm_dtype),
        )
    conv = torch.empty((len(stores), *first._conv_shape), dtype=conv_dtype, device=first._device)
    ssm = torch.empty((len(stores), *first._ssm_shape), dtype=ssm_dtype, device=first._device)
    for rank, crow, srow in reversed(list(zip(first.ranks, first._conv_rows, first._ssm_rows))):
        conv[:, crow] = rank.conv[region][ids.to(rank.conv[region].device)].to(first._device, conv_dtype)
        ssm[:, srow] = rank.ssm[region][ids.to(rank.ssm[region].device)].to(first._device, ssm_dtype)
    return conv, ssm


def write_ssm_many(
    stores: Sequence[PagedStateStore], layer: int, conv: Tensor, ssm: Tensor, index: StepIndex | None = None
) -> None:
    """Store row b of `conv` and `ssm` as request b's state (the inverse of `read_ssm_many`)."""
    if not stores:
        return
    first = stores[0]
    region, ids = _mamba_blocks(stores, layer, index)
    if first._whole_pages:  # one rank holds every row in order: the requests' pages written in place
        rank = first.ranks[0]
        dst_conv, dst_ssm = rank.conv[region], rank.ssm[region]
        dst_conv.index_copy_(0, ids.to(dst_conv.device), conv.to(dst_conv.device, dst_conv.dtype))
        dst_ssm.index_copy_(0, ids.to(dst_ssm.device), ssm.to(dst_ssm.device, dst_ssm.dtype))
        return
    for rank, crow, srow in zip(first.ranks, first._conv_rows, first._ssm_rows):
        dst_conv, dst_ssm = rank.conv[region], rank.ssm[region]
        dst_conv[ids.to(dst_conv.device)] = conv[:, crow].to(dst_conv.device, dst_conv.dtype)
        dst_ssm[ids.to(dst_ssm.device)] = ssm[:, srow].to(dst_ssm.device, dst_ssm.dtype)


def state_pages(
    stores: Sequence[PagedStateStore], layer: int, index: StepIndex | None = None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Where one rank holds every request's whole state and its conv and SSM pages are fp32
    with each page contiguous: those pages, conv `[pages, C, K-1]` and SSM `[pages,
    *ssm_shape]` (the cache's own memory), and the requests' page ids, for kernels that move the
    states on in place. None otherwise."""
    first = stores[0]
    if not first._whole_pages:
        return None
    region, ids = _mamba_blocks(stores, layer, index)
    conv, ssm = first.ranks[0].conv[region], first.ranks[0].ssm[region]
    if any(p.dtype != torch.float32 or not p[0].is_contiguous() for p in (conv, ssm)):
        return None
    return conv, ssm, ids.to(ssm.device)


def kv_pages(stores: Sequence[PagedStateStore], layer: int, index: StepIndex | None = None) -> tuple[Tensor, Tensor] | None:
    """Where one rank holds every KV head of fp32 K/V, each kernel block contiguous: the
    layer's cache `[kernel blocks, 2, heads, kernel_block_size, head_dim]` (its own memory) and
    the requests' block tables `[n, most blocks]` (logical block ids, zero after a request's
    own), for a kernel that reads K/V where they lie. None otherwise."""
    first = stores[0]
    if not first._whole_kv:
        return None
    lay = first.layout
    fa = first.ranks[0].fa[lay.region_of("attention", layer)]
    if fa.dtype != torch.float32 or not fa[0].is_contiguous():
        return None
    group = lay.group_of("attention", layer)
    if index is not None and group in index.tables:
        return fa, index.tables[group]
    tables = [s.blocks.block_ids[group] for s in stores]
    rows = np.zeros((len(stores), max(1, max(len(t) for t in tables))), dtype=np.int64)
    for b, t in enumerate(tables):  # in numpy: a row costs no tensor op
        rows[b, : len(t)] = t
    table = torch.from_numpy(rows)
    if index is not None:
        index.tables[group] = table
    return fa, table
