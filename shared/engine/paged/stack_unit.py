"""The fewest rows a batch-invariant decode step may pad to, found from the ops of one step.

Why stacks exist (tiles.py): an elementwise kernel runs a contiguous tensor two vectors at a
time and the remainder through a scalar loop, and the two round some functions otherwise (fp32
exp, sigmoid, SiLU, softplus). A stack whose rows are a multiple of STEP_BYTES over the element
size gives every tensor of any width a length with no remainder. But most of a step's tensors
are wide ([rows, hidden], [rows, heads, 32, 32]): any row count leaves them no remainder, and
most ops round alike in both loops anyway (an IEEE sum, product or quotient, a square root, a
copy, a comparison, a gather). Only the other ops on narrow tensors ([rows, heads] time steps,
[rows, 1] gates) need rows in multiples: a [rows, 8] fp32 tensor needs 4, a [rows, 1] one 32.

`stack_unit` runs a step under a recorder on a stack of a row count no model dimension is
likely to equal, notes every tensor of every op that may round otherwise (not in
ROUND_ALIKE_OPS) whose size is a multiple of that row count, and returns the fewest rows whose
multiples give each such tensor a length of whole vector steps, where the rows are the leading
dimension or any other (a tensor whose rows are not its leading dimension is checked for its
size after them too, the length of its inner loop). A recorded tensor that only looks like a
stack (its size a multiple of the row count by chance) can only ask for more rows, never fewer.
Ops the step did not run are not seen: the unit is found on a real step of the model, whose
ops and widths do not depend on the batch (a step with a first token adds only a clamp and a
select, which round alike).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from shared.engine.paged.call_sizes import SHORT_CALL_ROWS
from shared.engine.paged.tiles import STEP_BYTES, TILE_ROWS

# Rows of the traced stack, in units of a safe stack's rows: 7 x 32 = 224 fp32 rows, a count
# unlike the powers of two that model dimensions are made of.
TRACE_FACTOR = 7


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Ops whose every element rounds alike in a kernel's vector and scalar loops (a single IEEE
# operation, a comparison, a copy, a selection), or that do not compute on elements at all
# (views, allocation, indexing). GEMMs are here because their row counts are `linear`'s
# (call_sizes.py), not the stack's; sums and means only over the last dimension (below).
ROUND_ALIKE_OPS = _names(
    # views and allocation
    "view _unsafe_view reshape slice select expand permute transpose t unsqueeze squeeze as_strided"
    " alias detach split split_with_sizes unbind chunk narrow lift_fresh empty empty_like new_empty"
    " new_empty_strided empty_strided zeros zeros_like new_zeros ones ones_like full full_like"
    " new_full arange scalar_tensor"
    # copies, selection and indexing
    " clone copy_ cat stack index index_select gather index_put index_put_ _index_put_impl_"
    " index_copy index_copy_ scatter scatter_ fill_ zero_ embedding where masked_fill masked_fill_"
    " nonzero _local_scalar_dense sort topk argmax argmin max min amax amin"
    # comparisons and single IEEE operations
    " equal eq ne lt le gt ge logical_and logical_or logical_not maximum minimum clamp clamp_ clamp_min"
    " clamp_min_ clamp_max clamp_max_ relu relu_ abs neg sqrt rsqrt reciprocal mul mul_"
    # GEMMs (their row counts are linear's)
    " mm addmm bmm"
)
# A 16-bit rsqrt rounds otherwise in the two loops (test_stack_unit.py checks every op at every length).
_ALIKE_IN_FP32 = frozenset({"rsqrt"})
_ADDS = frozenset({"add", "add_", "sub", "sub_", "rsub"})
_DIVS = frozenset({"div", "div_"})
_LAST_DIM_REDUCTIONS = frozenset({"sum", "mean"})
_CASTS = frozenset({"_to_copy", "to"})


def _rounds_alike(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an op of this name and arguments rounds every element alike in both loops."""
    if name in _ALIKE_IN_FP32:
        return all(t.element_size() >= 4 for t in _tensors(args) if t.is_floating_point())
    if name in ROUND_ALIKE_OPS:
        return True
    if name in _ADDS:  # a + alpha * b is fused in the vector loop unless alpha is 1
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        return bool(alpha == 1)
    if name in _DIVS:
        return kwargs.get("rounding_mode") is None
    if name == "pow":  # x ** 2 is x * x in both loops
        return len(args) > 1 and not isinstance(args[1], Tensor) and args[1] == 2
    if name in _CASTS:  # a copy, or integers to floats (one IEEE rounding in both loops); a
        # float to another float may round otherwise in a scalar tail
        source = args[0] if args and isinstance(args[0], Tensor) else None
        if source is None:
            return False
        return not source.is_floating_point() or kwargs.get("dtype", source.dtype) == source.dtype
    if name in _LAST_DIM_REDUCTIONS:  # each row's order of sums depends on its own length only
        source = args[0]
        dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(source, Tensor) or dims is None or source.dim() == 0:
            return False
        dims = [dims] if isinstance(dims, int) else list(dims)
        return [d % source.dim() for d in dims] == [source.dim() - 1] and source.stride(-1) == 1
    return False


def rows_for_bytes(row_bytes: int) -> int:
    """The fewest rows whose multiples hold whole vector steps of rows of `row_bytes` bytes."""
    return STEP_BYTES // math.gcd(row_bytes, STEP_BYTES)


def _widths(t: Tensor, rows: int) -> Iterator[int]:
    """The bytes per row of `t` as one stack of `rows` rows, and after each dimension of `rows`."""
    yield t.numel() // rows * t.element_size()
    for i, size in enumerate(t.shape):
        if size == rows:
            yield math.prod(t.shape[i + 1 :]) * t.element_size()


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing compiled runs under the recorder, so torch need not wrap its dispatch in the
        # compiler's "disable", whose first call imports the compiler: hundreds of modules, tens
        # of MB resident for the process's life.
        return False

    def __init__(self, rows: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rows = rows
        self.unit = 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _rounds_alike(func.overloadpacket.__name__, args, kwargs):
            for t in _tensors(args, kwargs, out):
                if t.numel() and t.numel() % self.rows == 0 and t.is_floating_point():
                    for width in _widths(t, self.rows):
                        self.unit = max(self.unit, rows_for_bytes(width))
        return out


def _tensors(*trees: Any) -> Iterator[Tensor]:
    for tree in trees:
        if isinstance(tree, Tensor):
            yield tree
        elif isinstance(tree, (list, tuple)):
            yield from _tensors(*tree)
        elif isinstance(tree, dict):
            yield from _tensors(*tree.values())


def trace_rows(rows: int, dtype: torch.dtype) -> int:
    """The rows of a traced stack holding at least `rows` real ones: a multiple of TRACE_FACTOR
    safe stacks (whole vector steps in every column of `dtype`)."""
    unit = TRACE_FACTOR * (STEP_BYTES // dtype.itemsize)
    return -(-rows // unit) * unit


R = TypeVar("R")


def stack_unit(step: Callable[[int], R], rows: int) -> tuple[R, int]:
    """Run `step(rows)` (a step on a stack of `rows` rows, a trace_rows count) under the recorder:
    its result and the fewest rows a stack of the same step needs (a power of two, at most a safe
    stack's rows for the model's dtype)."""
    recorder = _Recorder(rows)
    with recorder:
        result = step(rows)
    return result, recorder.unit


def step_rows(rows: int, unit: int) -> int:
    """The rows of an invariant decode step of `rows` requests whose stacks need multiples of
    `unit` rows: whole units, in the row counts `linear`'s calls compute (short calls below a
    tile, whole tiles from one tile on), so no call pads its rows nor the step its calls."""
    step = max(unit, SHORT_CALL_ROWS if rows < TILE_ROWS else TILE_ROWS)
    return -(-rows // step) * step
