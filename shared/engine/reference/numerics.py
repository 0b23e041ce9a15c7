"""Small numeric building blocks shared by every layer, and the determinism switches.

Exact equality between a colocated run and a disaggregated run rests on two rules that live
here: every kernel runs on tensors of the same shape, strides and alignment in both runs
(`canonical`), and the process-wide switches that make torch pick reproducible kernels
(`configure_determinism`).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

RMS_EPS = 1e-6
L2_EPS = 1e-6
_ALIGNMENT = 64  # bytes; fresh torch allocations are aligned at least this much


def configure_determinism() -> None:
    """Ask torch for reproducible fp32 kernels: deterministic algorithms, no TF32.

    Process-wide; idempotent. On CUDA the cuBLAS workspace must be pinned before the first
    matmul, so the environment variable is set (unless the user set one) before any use.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # The same process-wide switch as `torch.use_deterministic_algorithms(True)` ("error": an op
    # without a deterministic kernel raises), without the compiler's config that call also sets:
    # importing it loads torch's whole compiler stack, seconds at every start-up of a service
    # running this engine, for a setting only compiled code reads.
    torch.set_deterministic_debug_mode("error")
    # Deterministic mode would also NaN-fill every torch.empty, touching every page of large
    # cache allocations elsewhere in the process; the engine never reads uninitialised memory.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def canonical(t: Tensor) -> Tensor:
    """`t` as a contiguous, freshly aligned tensor.

    BLAS libraries may choose a different code path (and rounding) for strided or misaligned
    operands, so state read from a paged cache is copied into the same memory form a dense
    store hands out before any math touches it.
    """
    if t.is_contiguous() and t.data_ptr() % _ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def rms_norm(x: Tensor, weight: Tensor, eps: float = RMS_EPS) -> Tensor:
    """RMSNorm over the last axis."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def l2_norm(x: Tensor, eps: float = L2_EPS) -> Tensor:
    """Unit-length rows (last axis), as GDN does to q and k."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def inverse_softplus(y: Tensor) -> Tensor:
    """x with softplus(x) == y (for storing a target dt as a bias)."""
    return y + torch.log(-torch.expm1(-y))
