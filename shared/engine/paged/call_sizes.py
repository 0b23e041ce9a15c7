"""Which row counts one invariant GEMM call may take for a weight: those proven to give every
row exactly its bits in a call of TILE_ROWS rows.

A call of TILE_ROWS rows is batch-invariant by construction (tiles.py). Other calls are faster:
fewer, larger ones (one 64-row call costs much less than four 16-row ones, and reads the weight
once), and for a few requests, a call of a few rows. But whether a row's bits depend on the
call's row count is up to the GEMM library: it picks its kernel, and with it each sum's order,
by shape. So a weight's calls take another row count only after `exact_calls` has shown, on
this machine, library, dtype and thread count, that it gives every row the bits of its tile
(for the larger calls, every multiple of the tile up to the size). GEMM kernels do not branch
on values, so the same bits on random rows mean the same order of sums for any rows. A library
that fails the check keeps tile-sized calls: slower, never inexact.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows of the largest call checked: a decode step of that many requests is one call per weight,
# a prefill step's rows go in calls of this size. The check runs every multiple of the tile up
# to it once per weight shape, and stops short where it would pass CHECK_FLOPS of GEMM (a large
# weight then keeps smaller calls, which its size already makes efficient).
MAX_CALL_ROWS = 256
CHECK_FLOPS = 5e9  # about 50 ms of fp32 GEMM on one CPU core

# Rows of the calls shorter than a tile that are checked too: a step of few requests then
# computes a few rows, not a whole tile (one row is not among them: a GEMV rounds otherwise).
SHORT_CALL_ROWS = 4

_PROBE_SEED = 20261206
_lock = threading.Lock()
_checked: dict[tuple[object, ...], CallSizes] = {}


@dataclass(frozen=True)
class CallSizes:
    """The calls of `F.linear` for one weight that give every row its bits in a call of `tile`
    rows: `short`, calls of fewer rows than a tile (ascending), and every multiple of the tile
    up to `largest` rows."""

    tile: int
    short: tuple[int, ...]
    largest: int

    def rows_for(self, rows: int) -> int:
        """The rows to compute for `rows` real ones (zero rows after them): the shortest checked
        call that holds them, else whole tiles."""
        for size in self.short:
            if rows <= size:
                return size
        return -(-rows // self.tile) * self.tile


def _key(weight: Tensor, bias: Tensor | None, tile: int) -> tuple[object, ...]:
    return (
        tile,
        tuple(weight.shape),
        weight.stride(),
        weight.dtype,
        weight.device,
        weight.data_ptr() % 64,  # a kernel may treat an unaligned operand differently
        None if bias is None else (bias.dtype, bias.data_ptr() % 64),
        torch.get_num_threads(),
    )


def exact_calls(weight: Tensor, bias: Tensor | None, tile: int) -> CallSizes:
    """The calls (at most MAX_CALL_ROWS rows) with which `F.linear(x, weight, bias)` gives each
    row of `x` the bits of the same row in a `tile`-row call. Checked once per shape, dtype,
    alignment and thread count, then remembered."""
    key = _key(weight, bias, tile)
    found = _checked.get(key)
    if found is None:
        short = list(range(SHORT_CALL_ROWS, tile, SHORT_CALL_ROWS))
        larger = checked_sizes(weight, tile)
        agree = agreements(weight, bias, tile, short + larger)
        found = CallSizes(
            tile, tuple(size for size, ok in zip(short, agree) if ok), largest_agreeing(larger, agree[len(short) :])
        )
        with _lock:
            _checked[key] = found
    return found


def checked_sizes(weight: Tensor, tile: int) -> list[int]:
    """The multiples of `tile` to check for `weight`, up to MAX_CALL_ROWS, as many as
    CHECK_FLOPS of GEMM allow with the check's other calls (its tiles and the short calls)."""
    per_row = 2 * weight.shape[0] * weight.shape[1]
    sizes, spent = [tile], (2 * tile + sum(range(SHORT_CALL_ROWS, tile, SHORT_CALL_ROWS))) * per_row
    for size in range(2 * tile, MAX_CALL_ROWS + 1, tile):
        spent += size * per_row
        if spent > CHECK_FLOPS:
            break
        sizes.append(size)
    return sizes


Gemm = Callable[[Tensor, Tensor, Tensor | None], Tensor]


def agreements(weight: Tensor, bias: Tensor | None, tile: int, sizes: Sequence[int], gemm: Gemm = F.linear) -> list[bool]:
    """For each of `sizes`: whether a call of `gemm` on that many rows gives each row the bits
    of the same row in its `tile`-row call (random rows, the same for every size)."""
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    total = -(-max(sizes) // tile) * tile
    rows = torch.randn((total, weight.shape[1]), generator=generator).to(weight.device, weight.dtype)
    tiled = torch.cat([gemm(rows[i : i + tile], weight, bias) for i in range(0, total, tile)])
    return [torch.equal(gemm(rows[:size], weight, bias), tiled[:size]) for size in sizes]


def largest_agreeing(sizes: Sequence[int], agree: Sequence[bool]) -> int:
    """The largest of `sizes` (ascending, the first a tile) up to which every size agrees; the
    first size, a tile, always serves."""
    agreed = sizes[0]
    for size, ok in zip(sizes, agree):
        if not ok:
            break
        agreed = size
    return agreed


def forget() -> None:
    """Drop every remembered check (tests that change the thread count or the sizes)."""
    with _lock:
        _checked.clear()
