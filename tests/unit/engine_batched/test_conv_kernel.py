"""The decode step's conv kernel (conv_kernel.py, built from conv_step_in_pages.c by the machine's
C compiler) against the torch path it replaces (conv_step.py on windows gathered out of the
pages): the outputs are its bits, the windows move on by one in the pages themselves, every
other byte of the cache stays untouched; a request's bits do not depend on the other requests;
bad arguments are refused before any memory is touched."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from shared.engine.paged.conv_kernel import ConvStepKernel, conv_step_kernel
from shared.engine.paged.conv_step import conv_step

CHANNELS, WIDTH, PAGES = 37, 4, 9


@pytest.fixture(scope="module")
def kernel() -> ConvStepKernel:
    built = conv_step_kernel()
    if built is None:
        pytest.fail("the conv kernel did not build: this machine has a C compiler, so it must")
    return built


def _cache(seed: int = 1) -> tuple[Tensor, Tensor]:
    """A cache whose conv pages interleave with other bytes (as a region's pages do): the whole
    buffer, and its pages [PAGES, C, K-1] as a strided view."""
    buffer = torch.randn(PAGES, 2, CHANNELS, WIDTH - 1, generator=torch.Generator().manual_seed(seed))
    return buffer, buffer[:, 1]


def _step_rows(n: int, seed: int = 0) -> Tensor:
    """n requests' new conv inputs as a projection's column slice: strided rows."""
    projected = torch.randn(n, CHANNELS + 11, generator=torch.Generator().manual_seed(seed))
    return projected[:, 5 : 5 + CHANNELS]


def _run(kernel: ConvStepKernel, pages: Tensor, ids: list[int], x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    out = torch.full((len(ids), CHANNELS), float("nan"))
    kernel(pages, torch.tensor(ids), x, weight, bias, out)
    return out


@pytest.mark.parametrize("with_bias", [True, False])
def test_outputs_are_the_torch_paths_bits_and_the_windows_move_on_in_place(kernel: ConvStepKernel, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(CHANNELS, WIDTH, generator=g), torch.randn(CHANNELS, generator=g) if with_bias else None
    ids = [6, 0, 3]
    buffer, pages = _cache()
    before = buffer.clone()
    x = _step_rows(len(ids))
    window = torch.cat([pages[ids], x[:, :, None]], dim=2)  # the torch path's window [n, C, K]
    out = _run(kernel, pages, ids, x, weight, bias)
    assert torch.equal(out, conv_step(window, weight, bias, len(ids)))
    assert torch.equal(pages[ids], window[:, :, 1:])
    changed = torch.zeros(PAGES, 2, dtype=torch.bool)
    changed[ids, 1] = True
    assert torch.equal(buffer[~changed], before[~changed])  # other pages and the bytes between pages
    # Negative control: the window summed newest first gives other bits somewhere, so the bit
    # comparison above tells sum orders apart.
    reversed_sum = (window.flip(2) * weight.flip(1)).sum(-1) + (0 if bias is None else bias)
    assert not torch.equal(out, reversed_sum)


def test_a_requests_bits_do_not_depend_on_the_other_requests(kernel: ConvStepKernel) -> None:
    weight, bias = torch.randn(CHANNELS, WIDTH), torch.randn(CHANNELS)
    _, pages = _cache(seed=3)
    start_window = pages[4].clone()
    alone_x = _step_rows(1, seed=5)
    alone_out = _run(kernel, pages, [4], alone_x, weight, bias)
    alone_window = pages[4].clone()
    for others, where in ((1, 0), (3, 2), (8, 5)):
        _, pages = _cache(seed=3 + others)
        pages[4] = start_window
        ids = [p for p in range(PAGES) if p != 4][:others]
        ids.insert(where, 4)
        x = _step_rows(len(ids), seed=others).clone()
        x[where] = alone_x[0]
        out = _run(kernel, pages, ids, x, weight, bias)
        assert torch.equal(out[where], alone_out[0]), (others, where)
        assert torch.equal(pages[4], alone_window), (others, where)


def test_bad_arguments_are_refused_before_memory_is_touched(kernel: ConvStepKernel) -> None:
    weight, bias = torch.randn(CHANNELS, WIDTH), torch.randn(CHANNELS)
    buffer, pages = _cache()
    before = buffer.clone()
    x = _step_rows(2)
    with pytest.raises(IndexError, match=r"page ids outside 0\.\.8"):
        _run(kernel, pages, [1, PAGES], x, weight, bias)
    with pytest.raises(IndexError):
        _run(kernel, pages, [-1, 0], x, weight, bias)
    with pytest.raises(ValueError, match="pages must be fp32"):
        _run(kernel, pages.double(), [0, 1], x, weight, bias)
    with pytest.raises(ValueError, match="conv kernel: pages"):
        _run(kernel, pages, [0, 1, 2], x, weight, bias)  # three ids, two requests' inputs
    with pytest.raises(ValueError, match="conv kernel: pages"):
        _run(kernel, pages, [0, 1], x, torch.randn(CHANNELS, WIDTH + 1), bias)  # a window wider than the pages'
    with pytest.raises(ValueError, match="each row contiguous"):
        _run(kernel, pages, [0, 1], x.t().contiguous().t(), weight, bias)
    with pytest.raises(ValueError, match="contiguous fp32"):
        _run(kernel, pages, [0, 1], x, weight.double(), bias)
    with pytest.raises(ValueError, match="conv kernel: out"):
        _run(kernel, pages, [0, 1], x, weight, torch.randn(CHANNELS + 1))
    assert torch.equal(buffer, before)
