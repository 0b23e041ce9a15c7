"""The paged engine's warm-up (`PagedEngine.warm_up`, run by the engine host at load): after it,
requests' prefills and steps check no GEMM call sizes of their own (call_sizes.py), for every
family and at both boundaries, and their bits are those of an engine that never warmed up. The
negative control: without the warm-up, the same requests do check (so the count could see it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

from shared.engine.paged import call_sizes
from shared.engine.paged.engine import PagedEngine
from shared.engine.paged.families import SUPPORTED_FAMILIES
from shared.engine.protocol import WarmsUp
from shared.layout.boundary import BOUNDARIES, Boundary
from tests.call_checks import count_checks
from tests.unit.engine_batched.helpers import BlockPool, logits_of, paged_engine, prompt_of, start

REQUESTS = 5
STEPS = 3


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    yield count_checks(monkeypatch)
    call_sizes.forget()


def _requests(engine: PagedEngine, pool: BlockPool) -> list[list[Tensor]]:
    """REQUESTS prompts of mixed lengths, then STEPS decode steps of them all: their logits."""
    sessions = [start(engine, pool, prompt_of(3 + 11 * i, salt=i), f"r{i}")[0] for i in range(REQUESTS)]
    out = []
    for _ in range(STEPS):
        engine.step_batch(sessions)
        out.append([logits_of(s) for s in sessions])
    return out


def _warmed(engine: PagedEngine, pool: BlockPool) -> None:
    assert isinstance(engine, WarmsUp)
    engine.warm_up(pool.blocks(engine.warm_up_tokens + 1, "warm-up"))


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_after_the_warm_up_requests_check_nothing_and_keep_their_bits(
    family: str, boundary: Boundary, hf_checkpoint: Callable[[str], str], checks: list[int]
) -> None:
    directory = hf_checkpoint(family)
    cold_engine = paged_engine(directory, boundary=boundary)
    cold = _requests(cold_engine, BlockPool(cold_engine.layout))
    call_sizes.forget()
    engine = paged_engine(directory, boundary=boundary)
    pool = BlockPool(engine.layout)
    before = len(checks)
    _warmed(engine, pool)
    warmed = len(checks)
    warm = _requests(engine, pool)
    assert warmed > before, f"{family}: the warm-up checked nothing"
    assert checks[warmed:] == [], f"{family}: checked at a request, not at the warm-up: {checks[warmed:]}"
    assert all(torch.equal(a, b) for sa, sb in zip(cold, warm) for a, b in zip(sa, sb)), family


def test_negative_control_without_the_warm_up_requests_check(hf_checkpoint: Callable[[str], str], checks: list[int]) -> None:
    engine = paged_engine(hf_checkpoint("nemotron_h"))
    _requests(engine, BlockPool(engine.layout))
    assert checks, "no check at a cold engine's first requests: the warm-up test could not see one"
