"""Why an invariant forward's rows are whole stacks (tiles.stack_rows): an elementwise kernel
runs the tail of a contiguous tensor through a scalar loop that rounds some fp32 functions
otherwise than its vector loop, so in a stack of 16-row tiles a narrow tensor's element can
change bits with the stack's length; in whole stacks it never does, in the model's dtype nor in
fp32 (a 16-bit model's SSM state and router scores)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.conv_step import conv_step
from shared.engine.paged.tiles import TILE_ROWS, stack_rows

FUNCTIONS: list[Callable[[Tensor], Tensor]] = [torch.sigmoid, F.silu, F.softplus, torch.exp, torch.tanh]
WIDTHS = range(1, 10)


def _rows_differ(row_counts: list[int], dtype: torch.dtype) -> list[tuple[str, int, int]]:
    """(function, width, rows) where the first row_counts[0] rows of a [rows, width] tensor get
    other bits than in a tensor of row_counts[0] rows."""
    torch.manual_seed(0)
    found = []
    for width in WIDTHS:
        x = (4 * torch.randn(max(row_counts), width)).to(dtype)
        for fn in FUNCTIONS:
            first = fn(x[: row_counts[0]].contiguous())
            for rows in row_counts[1:]:
                if not torch.equal(fn(x[:rows].contiguous())[: row_counts[0]], first):
                    found.append((fn.__name__, width, rows))
    return found


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_whole_stacks_give_every_row_the_same_bits(model_dtype: torch.dtype) -> None:
    unit = stack_rows(1, model_dtype)
    for dtype in {model_dtype, torch.float32}:
        assert _rows_differ([unit * k for k in (1, 2, 3, 4)], dtype) == [], dtype


def test_negative_control_stacks_of_tiles_do_not() -> None:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the scalar tail shows at 16-row multiples with AVX-512's 32-value steps")
    assert _rows_differ([TILE_ROWS * k for k in (1, 2, 3, 4, 5)], torch.float32) != []


def test_stack_rows_rounds_up_to_whole_stacks() -> None:
    assert [stack_rows(n, torch.float32) for n in (1, 32, 33)] == [32, 32, 64]
    assert [stack_rows(n, torch.bfloat16) for n in (1, 64, 65)] == [64, 64, 128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_conv_steps_products_and_sums_need_no_stack(dtype: torch.dtype) -> None:
    """A decode step's conv multiplies and sums on the requests' rows only (conv_step.py): each
    row gets the bits it gets beside any number of other rows, at widths with scalar tails too,
    and the rows after them are zero up to the stack."""
    torch.manual_seed(4)
    for channels, taps in ((384, 4), (648, 4), (7, 4), (5, 3), (33, 2)):
        weight, bias = torch.randn(channels, taps).to(dtype), torch.randn(channels).to(dtype)
        window = torch.randn(64, channels, taps).to(dtype)
        full = conv_step(window, weight, bias, 64)
        for n in range(1, 65):
            out = conv_step(window[:n], weight, bias, stack_rows(n, dtype))
            assert torch.equal(out[:n], full[:n]), (channels, taps, n)
            assert not out[n:].any()
