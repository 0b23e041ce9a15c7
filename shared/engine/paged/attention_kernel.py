"""A decode step's attention read straight from the requests' kernel blocks (attention_decode.c).

The torch path gathers every request's K/V out of its blocks into spans (one index_select of
every token row) and then runs two small matmuls and a softmax per request. The kernel reads
each key and value where it lies, through the requests' block tables, and computes each
request's attention in its own fixed order: the same bits for a request whatever shares its
step; last bits apart from the torch path's (its own sum orders and exp).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache

import torch
from torch import Tensor

from shared.engine.paged import native_library

_ptr, _int = ctypes.c_void_p, ctypes.c_int64
# What the kernel returns where it refused its arguments (it checks them before computing).
_BAD_LENGTH, _BAD_BLOCK = 1, 2


class AttentionKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.attention_decode
        self._fn.argtypes = [_ptr, _int, _int, _ptr, _int, _ptr, _int, _int, _int, _int, _int, _int, _int, _ptr, _ptr, _ptr, _ptr]
        self._fn.restype = _int

    def __call__(
        self, fa: Tensor, table: Tensor, lengths: Tensor, q: Tensor, *, block_size: int, kernels_per_block: int
    ) -> Tensor:
        """`fa` [kernel blocks, 2, kv_heads, kernel_block_size, head_dim] fp32, each kernel block
        contiguous; `table` [n, width] int64, request r's logical block ids; `lengths` [n] int64,
        the tokens each request attends over; `q` [n, heads, head_dim] fp32, scaled. Returns
        [n, heads, head_dim]."""
        n, heads, head_dim = q.shape
        kv_heads, kernel_block_size = fa.shape[2], fa.shape[3]
        if fa.shape[1] != 2 or fa.shape[4] != head_dim or heads % kv_heads or block_size % kernel_block_size:
            raise ValueError(f"attention kernel: fa {tuple(fa.shape)}, q {tuple(q.shape)}, block size {block_size}")
        if table.shape[0] != n or lengths.shape != (n,):
            raise ValueError(f"attention kernel: table {tuple(table.shape)} and lengths {tuple(lengths.shape)} for {n} queries")
        if fa.dtype != torch.float32 or not fa[0].is_contiguous() or fa.device.type != "cpu":
            raise ValueError("attention kernel: the cache must be fp32 CPU memory, each kernel block contiguous")
        if q.dtype != torch.float32 or not q.is_contiguous() or q.device.type != "cpu":
            raise ValueError("attention kernel: q must be a contiguous fp32 CPU tensor")
        table = table.to(torch.int64).contiguous()
        lengths = lengths.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        # room for the longest request's tokens (one beyond its table: refused by the kernel)
        longest = max(1, min(int(lengths.max()), table.shape[1] * block_size)) if n else 1
        scores = torch.empty(longest, dtype=torch.float32)
        kernel_blocks = torch.empty(-(-longest // kernel_block_size), dtype=torch.int64)
        bad = self._fn(
            fa.data_ptr(),
            fa.stride(0),
            fa.shape[0],
            table.data_ptr(),
            table.shape[1],
            lengths.data_ptr(),
            n,
            heads,
            kv_heads,
            head_dim,
            block_size,
            kernels_per_block,
            kernel_block_size,
            q.data_ptr(),
            out.data_ptr(),
            scores.data_ptr(),
            kernel_blocks.data_ptr(),
        )
        if bad == _BAD_LENGTH:
            raise IndexError(f"attention kernel: lengths {lengths.tolist()} need more blocks than the table's {table.shape[1]}")
        if bad == _BAD_BLOCK:
            raise IndexError(f"attention kernel: block ids outside the cache's {fa.shape[0] // kernels_per_block} blocks")
        return out


BLOCK_TOKENS = 16  # tokens per block of `blocks_of`' copies


def blocks_of(kv: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, int]:
    """Requests' K/V gathered head-major (`[kv_heads, S_b, hd]` each, as `read_kv_heads` gives
    them) laid out as a cache of blocks of BLOCK_TOKENS tokens, for the kernel where the heads
    lie on several ranks: (cache, block table, tokens per block). The kernel's bits do not
    depend on where a request's blocks lie, so this gives what the pages themselves would."""
    counts = [-(-k.shape[1] // BLOCK_TOKENS) for k, _ in kv]
    kv_heads, hd = kv[0][0].shape[0], kv[0][0].shape[2]
    fa = torch.zeros(sum(counts), 2, kv_heads, BLOCK_TOKENS, hd, dtype=torch.float32)
    table = torch.zeros(len(kv), max(counts), dtype=torch.int64)
    first = 0
    for b, ((k, v), count) in enumerate(zip(kv, counts)):
        for half, t in enumerate((k, v)):
            padded = torch.zeros(kv_heads, count * BLOCK_TOKENS, hd, dtype=torch.float32)
            padded[:, : t.shape[1]] = t
            fa[first : first + count, half] = padded.view(kv_heads, count, BLOCK_TOKENS, hd).transpose(0, 1)
        table[b, :count] = torch.arange(first, first + count)
        first += count
    return fa, table, BLOCK_TOKENS


@cache
def attention_kernel() -> AttentionKernel | None:
    """The built kernel, or None where it cannot be built (the torch path runs)."""
    library = native_library.load("attention_decode")
    return None if library is None else AttentionKernel(library)
