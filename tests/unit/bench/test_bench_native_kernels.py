"""`python -m hybridpd_tools.bench.native_kernels`: each batch's step times with the kernels and on
the torch path come from steps that really ran each way (the engine's switch flipped in turns)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hybridpd_tools.bench import native_kernels
from shared.engine.paged.engine import PagedEngine


def test_measure_times_both_paths_in_turns(hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_kernels, "BATCHES", (3,))
    seen: list[bool] = []
    step = PagedEngine.step_batch

    def recorded(self: PagedEngine, sessions: object) -> object:
        seen.append(self.native_kernels)
        return step(self, sessions)  # type: ignore[arg-type]

    monkeypatch.setattr(PagedEngine, "step_batch", recorded)
    ((batch, native, plain),) = native_kernels.measure(hf_checkpoint("nemotron_h"), steps=2, rounds=2)
    assert batch == 3 and native > 0 and plain > 0
    # a warm-up step each way, then two rounds of two steps each way, in turns
    assert seen == [True, False] + [True, True, False, False] * 2
