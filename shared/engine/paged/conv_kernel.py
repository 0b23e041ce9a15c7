"""A decode step's causal conv on the conv state pages in place (conv_step_in_pages.c).

The torch path gathers every request's conv window out of its page, appends the new input,
takes the products and sums, and scatters the moved window back: three copies of every window
besides the sum. The kernel reads each window in its page, sums it with the new input in the
torch path's order and moves it on in place.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from shared.engine.paged import native_library

_ptr, _int = ctypes.c_void_p, ctypes.c_int64
_BAD_PAGE = 1  # what the kernel returns for a page id outside the pages


class ConvStepKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.conv_step_in_pages
        self._fn.argtypes = [_ptr, _int, _int, _ptr, _int, _int, _int, _ptr, _int, _ptr, _ptr, _ptr]
        self._fn.restype = _int

    def __call__(self, pages: Tensor, page_ids: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> None:
        """One step of n requests: `pages` [pages, C, K-1] fp32 (request r's window in page
        `page_ids[r]`, moved on in place), `x` [n, C] the new inputs (rows may be strided),
        `weight` [C, K], `bias` [C] or None; writes the conv outputs into `out` [n, C]."""
        n, channels = x.shape
        width = weight.shape[1]
        if pages.shape[1:] != (channels, width - 1) or weight.shape != (channels, width) or page_ids.shape != (n,):
            raise ValueError(
                f"conv kernel: pages {tuple(pages.shape)}, ids {tuple(page_ids.shape)}, x {tuple(x.shape)}, "
                f"weight {tuple(weight.shape)}"
            )
        if out.shape != (n, channels) or (bias is not None and bias.shape != (channels,)):
            raise ValueError(f"conv kernel: out {tuple(out.shape)}, bias {None if bias is None else tuple(bias.shape)}")
        if pages.dtype != torch.float32 or not pages[0].is_contiguous() or pages.device.type != "cpu":
            raise ValueError("conv kernel: pages must be fp32 CPU memory, each page contiguous")
        dense = (weight, out) if bias is None else (weight, out, bias)
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in dense):
            raise ValueError("conv kernel: weight, bias and out must be contiguous fp32 CPU tensors")
        if x.dtype != torch.float32 or x.device.type != "cpu" or (n and x.stride(1) != 1):
            raise ValueError("conv kernel: x must be fp32 CPU rows, each row contiguous")
        ids = page_ids.to(torch.int64).contiguous()
        bad = self._fn(
            pages.data_ptr(),
            pages.stride(0),
            pages.shape[0],
            ids.data_ptr(),
            n,
            channels,
            width,
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
        )
        if bad == _BAD_PAGE:  # checked by the kernel before it computes anything
            raise IndexError(f"conv kernel: page ids outside 0..{pages.shape[0] - 1}")


@cache
def conv_step_kernel() -> ConvStepKernel | None:
    """The built kernel, or None where it cannot be built (the torch path runs)."""
    library = native_library.load("conv_step_in_pages")
    return None if library is None else ConvStepKernel(library)
