"""The warm-up benchmark (hybridpd_tools/bench/warm_up.py) measures what it says: a cold engine
spends nothing on a warm-up and its first request makes the call-size checks; a warmed one
makes them all in its warm-up and none in its first request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hybridpd_tools.bench.warm_up import first_request
from shared.engine.paged import call_sizes
from shared.engine.paged.engine import PagedEngine
from tests.call_checks import count_checks


def test_the_cold_first_request_checks_and_the_warmed_one_does_not(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = hf_checkpoint("nemotron_h")
    checked = count_checks(monkeypatch)
    after_warm_up: list[int] = []
    warm_up = PagedEngine.warm_up

    def noted(self: PagedEngine, blocks: Any) -> None:
        warm_up(self, blocks)
        after_warm_up.append(len(checked))

    monkeypatch.setattr(PagedEngine, "warm_up", noted)
    spent, first = first_request(directory, False)
    assert spent == 0.0 and first > 0 and checked and after_warm_up == []
    checked.clear()
    spent, first = first_request(directory, True)
    assert spent > 0 and first > 0
    assert after_warm_up == [len(checked)] and checked, (after_warm_up, checked)  # all in the warm-up
    call_sizes.forget()
