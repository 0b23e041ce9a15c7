"""The Mamba2 decode recurrence on the SSM state pages in place (mamba2_state_step.c).

The torch path gathers every request's state out of its page, updates the copy and scatters
it back: four passes over the states besides the update's own. The kernel updates each state
in its page and reads the output from it in the same pass. The new state is computed in
transformers' order (state * dA, then + dB x, each rounded; the torch path's addcmul_ fuses the
last multiply-add, so the two differ in last bits), and the output's sum over the state in the
kernel's fixed order: the same for every request whatever shares its step, on every machine.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
from torch import Tensor

from shared.engine.paged import native_library

_ptr, _int = ctypes.c_void_p, ctypes.c_int64
_BAD_PAGE = 1  # what the kernel returns for a page id outside the pages


class Mamba2StateKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.mamba2_state_step
        self._fn.argtypes = [_ptr, _int, _int, _ptr, _int, _int, _int, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]
        self._fn.restype = _int

    def __call__(
        self,
        pages: Tensor,
        page_ids: Tensor,
        decay: Tensor,
        dt: Tensor,
        x: Tensor,
        b: Tensor,
        c: Tensor,
        d_skip: Tensor,
        y: Tensor,
    ) -> None:
        """One step of n requests: `pages` [pages, H, P, N] fp32 (request r's state in page
        `page_ids[r]`, updated in place), `decay` and `dt` [n, H], `x` [n, H, P], `b` and `c`
        [n, G, N], `d_skip` [H]; writes the outputs into `y` [n, H, P]."""
        n, heads, head_dim = x.shape
        groups, d_state = b.shape[1], b.shape[2]
        if pages.shape[1:] != (heads, head_dim, d_state) or page_ids.shape != (n,) or heads % groups:
            raise ValueError(
                f"mamba2 kernel: pages {tuple(pages.shape)}, ids {tuple(page_ids.shape)}, x {tuple(x.shape)}, b {tuple(b.shape)}"
            )
        inputs = (decay, dt, x, b, c, d_skip, y)
        if pages.dtype != torch.float32 or not pages[0].is_contiguous() or pages.device.type != "cpu":
            raise ValueError("mamba2 kernel: pages must be fp32 CPU memory, each page contiguous")
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in inputs):
            raise ValueError("mamba2 kernel: every input must be a contiguous fp32 CPU tensor")
        ids = page_ids.to(torch.int64).contiguous()
        bad = self._fn(
            pages.data_ptr(),
            pages.stride(0),
            pages.shape[0],
            ids.data_ptr(),
            n,
            heads,
            head_dim,
            d_state,
            heads // groups,
            *(t.data_ptr() for t in inputs),
        )
        if bad == _BAD_PAGE:  # checked by the kernel before it computes anything
            raise IndexError(f"mamba2 kernel: page ids outside 0..{pages.shape[0] - 1}")


@cache
def mamba2_state_kernel() -> Mamba2StateKernel | None:
    """The built kernel, or None where it cannot be built (the torch path runs)."""
    library = native_library.load("mamba2_state_step")
    return None if library is None else Mamba2StateKernel(library)
