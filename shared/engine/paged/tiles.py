"""The row shapes that make a forward batch-invariant: every matmul over tokens goes through
`linear`, and every invariant forward pads its rows to whole stacks (`stack_rows`), or a
decode step to the fewer rows its model's ops are shown to need (stack_unit.py).

GEMMs. torch's CPU GEMM picks its kernel (and with it the summation order) by the number of
rows: a row's bits at M = 1 differ from the same row's at M = 2 or 64. For one fixed call shape,
though, a row's bits depend neither on its position nor on the other rows. So with `invariant`
the rows are padded to whole tiles of `TILE_ROWS` and F.linear runs on tiles of exactly that
shape, or on several tiles at once where call_sizes.py has shown that a call of that many rows
gives each row its own tile's bits; without it one F.linear covers every row (the fastest path,
and the negative control).

Row-wise kernels. An elementwise kernel runs a contiguous tensor through its vector loop two
vectors at a time and the remainder through a scalar loop, and the two round some functions
differently (fp32 sigmoid, SiLU, softplus): an element's bits then depend on the tensor's
length. A stack's rows (`stack_rows`) are a multiple of `STEP_BYTES` over the model's element
size, so every tensor of any width has a length that is a whole number of those steps and every
element takes the vector loop, whatever the batch. Padding rows come after the real ones (zero
where a stack starts; row-wise ops and biases may make them anything, which no real row sees);
`padding_after` tells `linear` where they start so that its calls skip the tiles that hold only
padding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.call_sizes import exact_calls

# Rows per GEMM tile in invariant mode; a chunk of a prefill stack starts on a whole tile.
TILE_ROWS = 16
# Bytes of one step of the widest vector loop: two AVX-512 vectors. A stack of a column of a
# 4-byte dtype holds 32 rows, of a 2-byte dtype 64 (an fp32 tensor of a bf16 model: two steps).
STEP_BYTES = 128


def pad_rows(x: Tensor, rows: int) -> Tensor:
    """`x` with zero rows appended up to `rows` rows (itself when it has them)."""
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], dim=0)


def stack_rows(rows: int, dtype: torch.dtype) -> int:
    """The rows of an invariant forward over `rows` real ones in a model of `dtype`: whole
    tiles, and whole vector steps in every column of that dtype (and of any wider one)."""
    unit = max(TILE_ROWS, STEP_BYTES // dtype.itemsize)
    return -(-rows // unit) * unit


def tile_rows(rows: int) -> int:
    """`rows` rounded up to whole tiles."""
    return -(-rows // TILE_ROWS) * TILE_ROWS


@dataclass(frozen=True)
class _Padding:
    total: int  # rows of the stack
    real: int  # rows before the padding


_padding: ContextVar[_Padding | None] = ContextVar("stack_padding", default=None)


@contextmanager
def padding_after(rows: int, total: int) -> Iterator[None]:
    """Within it, a tensor of `total` rows is a stack whose rows from `rows` on are padding, in
    order (a row-wise op keeps them so, and so does a gather of rows in order): `linear`
    computes only the calls its real rows need and gives zeros after those calls. Set per thread (a
    context variable)."""
    token = _padding.set(_Padding(total, rows))
    try:
        yield
    finally:
        _padding.reset(token)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, invariant: bool = False) -> Tensor:
    """`x @ weight.T + bias` over the rows of `x` ([rows, in]); with `invariant`, in calls that
    give each row its bits in a call of TILE_ROWS rows (call_sizes.py): whole tiles, as many in
    one call as checked, or fewer rows than a tile where checked, so each row's bits are
    independent of how many rows there are."""
    if not invariant:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padding = _padding.get()
    real = padding.real if padding is not None and padding.total == rows else rows
    calls = exact_calls(weight, bias, TILE_ROWS)
    computed = calls.rows_for(real)
    # A stack already holds rows after its real ones: the call takes them as they are (a row's
    # bits in a call do not depend on the other rows), so only a shorter tensor is padded.
    padded = (x[:computed] if rows >= computed else pad_rows(x, computed)).contiguous()
    step = calls.largest
    if computed <= step:
        out = F.linear(padded, weight, bias)
    else:
        out = torch.cat([F.linear(padded[i : i + step], weight, bias) for i in range(0, computed, step)])
    if out.shape[0] > rows:
        return out[:rows]
    return pad_rows(out, rows)
