"""The memory layout of the GEMM weights: each stays a `[out, in]` tensor to the code that uses
it, but on a CPU an fp32 one is stored `[in, out]` (its transpose contiguous).

`F.linear(x, w)` multiplies by `w.T`. With `w` stored `[in, out]` that operand is a plain
row-major matrix, which MKL's fp32 GEMM runs faster at a decode step's row counts than the
transposed operand of a checkpoint's `[out, in]` weight (the kernels differ, and so do their
bits: call_sizes.py checks each layout on its own). 16-bit GEMMs and GPU GEMMs gain nothing
from it, so their weights keep the checkpoint's layout.

Which fields of a mixer are GEMM weights, each class says in `GEMM_WEIGHTS`; `lay_out` walks a
model's dataclasses and re-lays those out once, after loading.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor


def gemm_weight(weight: Tensor) -> Tensor:
    """`weight` ([out, in]) in the layout `F.linear` runs fastest here: the same values and
    shape, stored transposed on a CPU in fp32, as it is elsewhere."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return weight
    return weight.t().contiguous().t()


def lay_out(root: Any) -> None:
    """Re-lay out, in place, every field named in a `GEMM_WEIGHTS` of `root` or of a dataclass
    reachable from it through fields and lists (each object once). A GEMM weight that is also a
    field that is not one (an LM head tied to the embedding: the same memory) keeps its layout:
    laying it out would hold the matrix twice."""
    gemm: list[tuple[Any, str, Tensor]] = []
    other: set[int] = set()  # where the tensors that are not GEMM weights start in memory
    seen: set[int] = set()
    pending: list[Any] = [root]
    while pending:
        obj = pending.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, list | tuple):
            pending.extend(obj)
            continue
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            continue
        names = getattr(obj, "GEMM_WEIGHTS", ())
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if not isinstance(value, Tensor):
                pending.append(value)
            elif field.name in names:
                gemm.append((obj, field.name, value))
            else:
                other.add(value.data_ptr())
    for obj, name, weight in gemm:
        if weight.data_ptr() not in other:
            setattr(obj, name, gemm_weight(weight))
