"""Counting the paged engine's GEMM call-size checks (shared/engine/paged/call_sizes.py) in a test."""

from __future__ import annotations

from typing import Any

import pytest
from torch import Tensor

from shared.engine.paged import call_sizes


def count_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every call-size check from now on, by its weight's output features; none remembered before
    (what earlier tests in the process checked would hide them). The caller forgets them after."""
    call_sizes.forget()
    seen: list[int] = []
    agreements = call_sizes.agreements

    def counted(weight: Tensor, *rest: Any, **named: Any) -> list[bool]:
        seen.append(weight.shape[0])
        return agreements(weight, *rest, **named)

    monkeypatch.setattr(call_sizes, "agreements", counted)
    return seen
