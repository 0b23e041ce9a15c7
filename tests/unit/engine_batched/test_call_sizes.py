"""Invariant GEMMs in calls of many tiles (call_sizes.py, tiles.linear): a row's bits equal its
own 16-row tile's for any row count and place, the check says no where a GEMM's rounding
follows its row count, and a stack's padding tiles are skipped without touching the real rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged import call_sizes
from shared.engine.paged.tiles import TILE_ROWS, linear, padding_after, stack_rows


def _tiled(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The construction: each row in a call of exactly TILE_ROWS rows, zero-padded."""
    rows = x.shape[0]
    padded = torch.cat([x, x.new_zeros((-rows % TILE_ROWS, x.shape[1]))])
    out = [F.linear(padded[i : i + TILE_ROWS], weight, bias) for i in range(0, padded.shape[0], TILE_ROWS)]
    return torch.cat(out)[:rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features", "with_bias"), [(648, 256, False), (320, 256, True), (1, 256, False)])
def test_every_row_count_gives_each_row_its_tile_bits(
    out_features: int, in_features: int, with_bias: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    x = torch.randn(300, in_features).to(dtype)
    for rows in (1, 2, 3, 15, 16, 17, 33, 64, 100, 255, 256, 257, 300):
        assert torch.equal(linear(x[:rows], weight, bias, invariant=True), _tiled(x[:rows], weight, bias)), rows
    calls = call_sizes.exact_calls(weight, bias, TILE_ROWS)
    assert calls.largest % TILE_ROWS == 0 and all(size < TILE_ROWS for size in calls.short)


def test_the_check_refuses_a_gemm_whose_rounding_follows_its_row_count() -> None:
    """Negative control with a named fake GEMM: the library here gives every multiple of 16 rows
    the same bits, so the condition is made on demand. This GEMM sums in float64 once a call has
    more than 32 rows (as a library might switch kernels there)."""

    def switching(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[0] <= 32:
            return F.linear(x, weight, bias)
        return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)

    torch.manual_seed(1)
    weight = torch.randn(96, 256)
    sizes = range(TILE_ROWS, 129, TILE_ROWS)
    switched = call_sizes.agreements(weight, None, TILE_ROWS, sizes, gemm=switching)
    assert switched == [size <= 32 for size in sizes]
    assert call_sizes.largest_agreeing(sizes, switched) == 32
    assert call_sizes.largest_agreeing(sizes, call_sizes.agreements(weight, None, TILE_ROWS, sizes)) == 128
    assert call_sizes.largest_agreeing(sizes, [False] * len(sizes)) == TILE_ROWS  # a tile always serves


def test_short_calls_are_used_only_where_checked() -> None:
    """A call of fewer rows than a tile computes a few requests' rows only where the check found
    it gives the tile's bits; the named fake below rounds every call under a tile otherwise."""

    def short_differs(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if x.shape[0] >= TILE_ROWS:
            return F.linear(x, weight, bias)
        return F.linear(x.double(), weight.double(), None).to(x.dtype)

    torch.manual_seed(4)
    weight = torch.randn(96, 256)
    assert call_sizes.agreements(weight, None, TILE_ROWS, [4, 8, TILE_ROWS], gemm=short_differs) == [False, False, True]
    assert call_sizes.CallSizes(TILE_ROWS, (), TILE_ROWS).rows_for(3) == TILE_ROWS
    assert call_sizes.CallSizes(TILE_ROWS, (4, 8), 64).rows_for(3) == 4
    assert call_sizes.CallSizes(TILE_ROWS, (4, 8), 64).rows_for(9) == TILE_ROWS
    assert call_sizes.CallSizes(TILE_ROWS, (4, 8), 64).rows_for(40) == 48


def test_one_row_calls_round_otherwise_here() -> None:
    """Why the construction pads to whole tiles: on this machine a 1-row call (a GEMV) rounds
    differently from the same row in a 16-row call, and the check sees it."""
    torch.manual_seed(2)
    weight = torch.randn(648, 256)
    x = torch.randn(TILE_ROWS, 256)
    if torch.equal(F.linear(x[:1], weight), F.linear(x, weight)[:1]):
        pytest.skip("this machine's GEMM gives a 1-row call its tile's bits")
    assert call_sizes.agreements(weight, None, TILE_ROWS, [1]) == [False]


def test_padding_tiles_are_skipped_and_real_rows_unchanged() -> None:
    torch.manual_seed(3)
    weight, bias = torch.randn(128, 256), torch.randn(128)
    real = 20
    stack = torch.cat([torch.randn(real, 256), torch.zeros(stack_rows(real, torch.float32) - real, 256)])
    whole = linear(stack, weight, bias, invariant=True)
    with padding_after(real, stack.shape[0]):
        skipped = linear(stack, weight, bias, invariant=True)
        other_rows = linear(stack[:48], weight, bias, invariant=True)  # not the stack: computed whole
    live = -(-real // TILE_ROWS) * TILE_ROWS
    assert torch.equal(skipped[:live], whole[:live])
    assert torch.equal(skipped[live:], torch.zeros_like(skipped[live:]))
    assert torch.equal(other_rows, whole[:48])


def test_the_check_runs_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    call_sizes.forget()
    checks: list[int] = []
    check = call_sizes.agreements

    def counted(*args: object, **kwargs: object) -> list[bool]:
        checks.append(1)
        return check(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(call_sizes, "agreements", counted)
    weight = torch.randn(64, 128)
    call_sizes.exact_calls(weight, None, TILE_ROWS)
    after_first = len(checks)
    call_sizes.exact_calls(weight, None, TILE_ROWS)
    assert len(checks) == after_first
    call_sizes.exact_calls(torch.randn(32, 128), None, TILE_ROWS)
    assert len(checks) == 2 * after_first


def test_the_check_of_a_large_weight_stays_within_its_budget() -> None:
    small = call_sizes.checked_sizes(torch.empty(648, 256, device="meta"), TILE_ROWS)
    assert small == list(range(TILE_ROWS, call_sizes.MAX_CALL_ROWS + 1, TILE_ROWS))
    large = torch.empty(151936, 4096, device="meta")  # a real vocabulary's head
    sizes = call_sizes.checked_sizes(large, TILE_ROWS)
    assert sizes[0] == TILE_ROWS and sizes == list(range(TILE_ROWS, sizes[-1] + 1, TILE_ROWS))
    flops = 2 * large.shape[0] * large.shape[1] * (TILE_ROWS + sum(sizes) + sum(range(4, TILE_ROWS, 4)))
    assert len(sizes) == 1 or flops <= call_sizes.CHECK_FLOPS
