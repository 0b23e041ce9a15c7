"""The warm-up benchmark (hybridpd_tools/bench/warm_up.py) measures what it says: a cold engine
spends nothing on a warm-up and its first request makes the call-size checks; a warmed one
makes them all in its warm-up and none in its first request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch import Tensor

from hybridpd_tools.bench.warm_up import first_request
from shared.engine.paged import call_sizes
from shared.engine.paged.engine import PagedEngine


def test_the_cold_first_request_checks_and_the_warmed_one_does_not(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = hf_checkpoint("nemotron_h")
    checked: list[int] = []
    after_warm_up: list[int] = []
    agreements, warm_up = call_sizes.agreements, PagedEngine.warm_up

    def counted(weight: Tensor, *rest: Any, **named: Any) -> list[bool]:
        checked.append(weight.shape[0])
        return agreements(weight, *rest, **named)

    def noted(self: PagedEngine, blocks: Any) -> None:
        warm_up(self, blocks)
        after_warm_up.append(len(checked))

    monkeypatch.setattr(call_sizes, "agreements", counted)
    monkeypatch.setattr(PagedEngine, "warm_up", noted)
    spent, first = first_request(directory, False)
    assert spent == 0.0 and first > 0 and checked and after_warm_up == []
    checked.clear()
    spent, first = first_request(directory, True)
    assert spent > 0 and first > 0
    assert after_warm_up == [len(checked)] and checked, (after_warm_up, checked)  # all in the warm-up
    call_sizes.forget()
