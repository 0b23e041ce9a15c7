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


def _kv_slots(stores: Sequence[PagedStateStore], layer: int, positions: Sequence[np.ndarray]) -> tuple[int, Tensor, Tensor]:
    kernels, slots = [], []
    region = 0
    for store, pos in zip(stores, positions):
        region, kernel, slot = store._token_slots(layer, pos)
        kernels.append(kernel)
        slots.append(slot)
    return region, torch.cat(kernels), torch.cat(slots)


def write_kv_tokens(stores: Sequence[PagedStateStore], layer: int, positions: Sequence[int], k: Tensor, v: Tensor) -> None:
    """Store K and V (`[B, kv_heads, head_dim]`, row b for request b) of one token per request,
    request b's at position `positions[b]`."""
    if not stores:
        return
    region, kernel, slot = _kv_slots(stores, layer, [np.array([p]) for p in positions])
    first = stores[0]
    for rank, heads in zip(first.ranks, first._kv_heads):
        fa = rank.fa[region]
        fa[kernel, 0, :, slot, :] = k[:, heads].to(fa.device, fa.dtype)
        fa[kernel, 1, :, slot, :] = v[:, heads].to(fa.device, fa.dtype)


def read_kv_many(
    stores: Sequence[PagedStateStore], layer: int, lengths: Sequence[int], dtype: torch.dtype
) -> list[tuple[Tensor, Tensor]]:
    """K and V of positions 0..lengths[b]-1 of every request b (`[T_b, kv_heads, head_dim]`, in
    `dtype`), gathered in one indexing op per rank."""
    if not stores:
        return []
    first = stores[0]
    spec = first.layout.spec
    region, kernel, slot = _kv_slots(stores, layer, [np.arange(n) for n in lengths])
    shape = (int(kernel.shape[0]), spec.attention.num_kv_heads, spec.attention.head_dim)
    out_k = torch.empty(shape, dtype=dtype, device=first._device)
    out_v = torch.empty(shape, dtype=dtype, device=first._device)
    for rank, heads in reversed(list(zip(first.ranks, first._kv_heads))):
        fa = rank.fa[region]
        out_k[:, heads] = fa[kernel, 0, :, slot, :].to(first._device, dtype)
        out_v[:, heads] = fa[kernel, 1, :, slot, :].to(first._device, dtype)
    ks, vs = torch.split(out_k, list(lengths)), torch.split(out_v, list(lengths))
    return list(zip(ks, vs))


def _mamba_blocks(stores: Sequence[PagedStateStore], layer: int) -> tuple[int, Tensor]:
    region, ids = 0, []
    for store in stores:
        region, block = store._mamba_block(layer)
        ids.append(block)
    return region, torch.tensor(ids, dtype=torch.long)


def read_ssm_many(
    stores: Sequence[PagedStateStore], layer: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Every request's conv `[B, C, K-1]` and SSM state `[B, *ssm_shape]`, in the given dtypes."""
    first = stores[0]
    region, ids = _mamba_blocks(stores, layer)
    conv = torch.empty((len(stores), *first._conv_shape), dtype=conv_dtype, device=first._device)
    ssm = torch.empty((len(stores), *first._ssm_shape), dtype=ssm_dtype, device=first._device)
    for rank, crow, srow in reversed(list(zip(first.ranks, first._conv_rows, first._ssm_rows))):
        conv[:, crow] = rank.conv[region][ids.to(rank.conv[region].device)].to(first._device, conv_dtype)
        ssm[:, srow] = rank.ssm[region][ids.to(rank.ssm[region].device)].to(first._device, ssm_dtype)
    return conv, ssm


def write_ssm_many(stores: Sequence[PagedStateStore], layer: int, conv: Tensor, ssm: Tensor) -> None:
    """Store row b of `conv` and `ssm` as request b's state (the inverse of `read_ssm_many`)."""
    if not stores:
        return
    first = stores[0]
    region, ids = _mamba_blocks(stores, layer)
    for rank, crow, srow in zip(first.ranks, first._conv_rows, first._ssm_rows):
        dst_conv, dst_ssm = rank.conv[region], rank.ssm[region]
        dst_conv[ids.to(dst_conv.device)] = conv[:, crow].to(dst_conv.device, dst_conv.dtype)
        dst_ssm[ids.to(dst_ssm.device)] = ssm[:, srow].to(dst_ssm.device, dst_ssm.dtype)
