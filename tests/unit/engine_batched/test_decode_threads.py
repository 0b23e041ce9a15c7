"""A step's tiles on several decode threads (`decode_threads`): the logits of every request and
every byte of the caches are the same with 1 and with N threads, from the first step that
uses the workers (fresh worker threads) on; and the negative control: the same comparison sees
the difference that one GEMM over the batch makes (so it could see a thread's)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from shared.engine.paged.engine import PagedEngine
from shared.engine.paged.families import SUPPORTED_FAMILIES
from shared.engine.paged.stack_unit import step_rows, trace_rows
from tests.unit.engine_batched.helpers import BlockPool, logits_of, paged_engine, prompt_of, start

REQUESTS = 40  # three tiles: 16, 16 and 8 requests
STEPS = 3


def _run(engine: PagedEngine) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Every request's logits per step, and the bytes of every cache region after the steps."""
    pool = BlockPool(engine.layout)
    sessions = [start(engine, pool, prompt_of(1 + (7 * i) % 29, salt=i), f"r{i}")[0] for i in range(REQUESTS)]
    logits = []
    for _ in range(STEPS):
        engine.step_batch(sessions)
        logits.append([logits_of(s) for s in sessions])
    return logits, [region.clone() for rank in engine.ranks for region in rank.cache.regions]


def _same(a: tuple[list[list[Tensor]], list[Tensor]], b: tuple[list[list[Tensor]], list[Tensor]]) -> bool:
    steps_a, caches_a = a
    steps_b, caches_b = b
    logits_equal = all(torch.equal(x, y) for sa, sb in zip(steps_a, steps_b) for x, y in zip(sa, sb))
    return logits_equal and all(torch.equal(x, y) for x, y in zip(caches_a, caches_b))


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_tiles_on_several_threads_give_one_threads_bytes(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    one = _run(paged_engine(directory))
    for threads in (2, 3):
        assert _same(one, _run(paged_engine(directory, decode_threads=threads))), (family, threads)


def test_bf16_tiles_on_several_threads_give_one_threads_bytes(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("nemotron_h")
    one = _run(paged_engine(directory, dtype="bf16"))
    assert _same(one, _run(paged_engine(directory, dtype="bf16", decode_threads=3)))


def test_negative_control_the_comparison_sees_other_bits(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("nemotron_h")
    other = paged_engine(directory, invariant=False, decode_threads=3)
    assert not _same(_run(paged_engine(directory)), _run(other)), "one GEMM over 40 rows gave the tiles' bits"


def test_decode_threads_must_be_positive(hf_checkpoint: Callable[[str], str]) -> None:
    engine = paged_engine(hf_checkpoint("nemotron_h"))
    with pytest.raises(ValueError, match="decode_threads"):
        PagedEngine(engine.layout, engine.ranks, engine.checkpoint, decode_threads=0)


@pytest.mark.parametrize(("threads", "shares"), [(1, [40]), (2, [16, 24]), (3, [16, 16, 8])])
def test_a_step_is_one_forward_per_thread_share(
    threads: int, shares: list[int], hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each thread's share of whole tiles is one forward over one stack (tiles.py), not one
    forward per tile; the engine's first step is one forward on the calling thread over a traced
    stack (stack_unit.py)."""
    engine = paged_engine(hf_checkpoint("nemotron_h"), decode_threads=threads)
    forwards: list[tuple[int, int]] = []
    forward = engine.model.forward_step

    def counted(ids, stores, positions, *, rows, invariant, native):  # type: ignore[no-untyped-def]
        forwards.append((len(ids), rows))
        return forward(ids, stores, positions, rows=rows, invariant=invariant, native=native)

    monkeypatch.setattr(engine.model, "forward_step", counted)
    _run(engine)
    unit = engine.decode_stack_unit
    assert unit is not None
    assert forwards[0] == (REQUESTS, trace_rows(REQUESTS, torch.float32))
    later = forwards[1:]
    assert sorted(later[: len(shares)], reverse=True) == sorted(((n, step_rows(n, unit)) for n in shares), reverse=True)
    assert len(later) == (STEPS - 1) * len(shares)
