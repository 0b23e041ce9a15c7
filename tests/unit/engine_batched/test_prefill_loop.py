"""Prefill's step loop (shared/runtime/prefill_loop.py) on a real paged engine and compute
thread: which chunks share a step (oldest first, within the token budget, one chunk a job), a
chunk withdrawn before its step never runs, and a job's bits are those of its prefill alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch
from opentelemetry.context import Context

from shared.engine.paged.engine import PagedEngine, PagedPrefillRun
from shared.engine.prefill_chunks import chunk_ends
from shared.observe import BATCH_SIZE, TOKENS, Attributes, Observer, Sink, Stage, number
from shared.runtime.compute_thread import ComputeThread
from shared.runtime.prefill_loop import ChunkDone, PrefillLoop
from tests.unit.engine_batched.helpers import BlockPool, paged_engine, prompt_of

FAMILY = "nemotron_h"


class Steps(Sink):
    """The loop under test, with every step's (chunks, tokens) recorded."""

    def __init__(self, engine: PagedEngine, budget: int) -> None:
        self.thread = ComputeThread("test-prefill")
        self.loop = PrefillLoop(engine, self.thread.submit, budget)
        self.seen: list[tuple[int, int]] = []
        self.loop.observer = Observer(self)

    def stage(self, stage: Stage, seconds: float, attributes: Attributes, within: Context | None) -> None:
        assert stage is Stage.PREFILL_STEP
        self.seen.append((int(number(attributes, BATCH_SIZE)), int(number(attributes, TOKENS))))

    async def close(self) -> None:
        await self.loop.aclose()
        self.thread.shutdown()


async def _prefill(steps: Steps, run: PagedPrefillRun, n: int, chunk: int) -> ChunkDone:
    order, start, done = steps.loop.arrival(), 0, None
    for end in chunk_ends(0, n, chunk):
        done = await steps.loop.compute(run, start, end, order)
        start = end
    assert done is not None
    return done


def _runs(engine: PagedEngine, lengths: list[int]) -> list[PagedPrefillRun]:
    pool = BlockPool(engine.layout)
    return [engine.start_prefill(prompt_of(n, salt=i), pool.blocks(n, f"r{i}")) for i, n in enumerate(lengths)]


def test_budget_takes_the_oldest_then_what_fits(hf_checkpoint: Callable[[str], str]) -> None:
    engine = paged_engine(hf_checkpoint(FAMILY))

    async def main() -> list[tuple[int, int]]:
        steps = Steps(engine, budget=100)
        # 120 arrives first: alone over the budget, it still runs first, alone; then 60 + 30 fit
        # (the 50 after them does not: it waits for the next step).
        lengths = [120, 60, 50, 30]
        runs = _runs(engine, lengths)
        await asyncio.gather(*(_prefill(steps, r, engine.num_prefill_tokens(n), 0) for r, n in zip(runs, lengths)))
        await steps.close()
        return steps.seen

    assert asyncio.run(main()) == [(1, 120), (2, 90), (1, 50)]


def test_a_long_prompt_in_chunks_shares_its_steps(hf_checkpoint: Callable[[str], str]) -> None:
    """64 tokens in chunks of 16 take four steps; the three short prompts arriving with it
    share its first step instead of waiting for all of it."""
    engine = paged_engine(hf_checkpoint(FAMILY), chunk=16)

    async def main() -> tuple[list[tuple[int, int]], list[int]]:
        steps = Steps(engine, budget=64)
        lengths = [64, 10, 12, 9]
        runs = _runs(engine, lengths)
        done = await asyncio.gather(*(_prefill(steps, r, engine.num_prefill_tokens(n), 16) for r, n in zip(runs, lengths)))
        await steps.close()
        return steps.seen, [d.batch_size for d in done]

    seen, last_batch = asyncio.run(main())
    assert seen == [(4, 47), (1, 16), (1, 16), (1, 16)]
    assert last_batch == [1, 4, 4, 4]


def test_a_steps_jobs_come_back_to_the_next_step_together(hf_checkpoint: Callable[[str], str]) -> None:
    """Three prompts of four chunks: the first runs its first chunk alone while the other two
    queue. The next step waits for the first job's next chunk, so from then on the three share
    every step; taken at once instead, the two waiting ones and the first would alternate."""
    engine = paged_engine(hf_checkpoint(FAMILY), chunk=16)

    async def main() -> list[tuple[int, int]]:
        steps = Steps(engine, budget=64)
        gate = asyncio.Event()
        opened = asyncio.get_running_loop().create_future()

        def held() -> None:  # occupies the compute thread until the gate opens
            opened.get_loop().call_soon_threadsafe(opened.set_result, None)
            asyncio.run_coroutine_threadsafe(gate.wait(), opened.get_loop()).result()

        blocker = steps.thread.submit(held)
        await opened
        runs = _runs(engine, [64, 64, 64])
        n = engine.num_prefill_tokens(64)
        first = asyncio.ensure_future(_prefill(steps, runs[0], n, 16))
        for _ in range(5):  # the loop takes the first chunk alone and queues its step behind the blocker
            await asyncio.sleep(0)
        others = [asyncio.ensure_future(_prefill(steps, r, n, 16)) for r in runs[1:]]
        for _ in range(5):
            await asyncio.sleep(0)
        gate.set()
        await blocker
        await asyncio.gather(first, *others)
        await steps.close()
        return steps.seen

    assert [chunks for chunks, _ in asyncio.run(main())] == [1, 3, 3, 3, 2]


def test_a_chunk_withdrawn_before_its_step_never_runs(hf_checkpoint: Callable[[str], str]) -> None:
    engine = paged_engine(hf_checkpoint(FAMILY))

    async def main() -> tuple[int, int]:
        steps = Steps(engine, budget=1)  # one chunk a step: the second waits behind the first
        first, second = _runs(engine, [20, 20])
        a = asyncio.ensure_future(_prefill(steps, first, 20, 0))
        b = asyncio.ensure_future(_prefill(steps, second, 20, 0))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        b.cancel()
        await a
        with pytest.raises(asyncio.CancelledError):
            await b
        await steps.close()
        return first.computed, second.computed

    assert asyncio.run(main()) == (20, 0)


@pytest.mark.parametrize("invariant", [True, False])
def test_bits_equal_the_prefill_alone_only_with_invariance(hf_checkpoint: Callable[[str], str], invariant: bool) -> None:
    """24 prompts of 1..45 tokens at once, in chunks of 16: each one's last logits are those of
    its prefill alone; with invariance off (the chunks packed, one GEMM over them: the negative
    control) some differ."""
    engine = paged_engine(hf_checkpoint(FAMILY), chunk=16, invariant=invariant)
    lengths = [1 + (i * 11) % 45 for i in range(24)]

    async def main() -> list[PagedPrefillRun]:
        steps = Steps(engine, budget=2048)
        runs = _runs(engine, lengths)
        await asyncio.gather(*(_prefill(steps, r, engine.num_prefill_tokens(n), 16) for r, n in zip(runs, lengths)))
        await steps.close()
        assert steps.loop.largest_batch >= 8
        return runs

    together = asyncio.run(main())
    same = []
    for i, (run, n) in enumerate(zip(together, lengths)):
        alone = _runs(engine, [1] * i + [n])[-1]
        for end in chunk_ends(0, engine.num_prefill_tokens(n), 16):
            alone.compute(end)
        assert run.last_logits is not None and alone.last_logits is not None
        same.append(torch.equal(run.last_logits, alone.last_logits))
    if invariant:
        assert all(same), same
    else:
        assert not all(same), "packing the chunks changed no bit: the check cannot fail"


def test_a_job_cancelled_during_its_step_ends_with_the_step(hf_checkpoint: Callable[[str], str]) -> None:
    """Cancelled while its chunk is in a running step, a job's wait ends only once the step has
    (nothing writes its blocks after that), and the job beside it gets its bits."""
    engine = paged_engine(hf_checkpoint(FAMILY))

    async def main() -> tuple[bool, bool, PagedPrefillRun]:
        steps = Steps(engine, budget=2048)
        gate = asyncio.Event()
        opened = asyncio.get_running_loop().create_future()

        def held() -> None:  # occupies the compute thread until the gate opens
            opened.get_loop().call_soon_threadsafe(opened.set_result, None)
            asyncio.run_coroutine_threadsafe(gate.wait(), opened.get_loop()).result()

        blocker = steps.thread.submit(held)
        await opened
        cancelled, kept = _runs(engine, [30, 25])
        a = asyncio.ensure_future(_prefill(steps, cancelled, 30, 0))
        b = asyncio.ensure_future(_prefill(steps, kept, 25, 0))
        for _ in range(5):  # the loop takes both chunks and queues their step behind the blocker
            await asyncio.sleep(0)
        a.cancel()
        await asyncio.sleep(0.05)
        waited = not a.done()  # its step has not run yet: the cancelled job still waits for it
        gate.set()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await a
        await b
        stepped = cancelled.computed == 30  # it was in the step, so its chunk was computed
        await steps.close()
        return waited, stepped, kept

    waited, stepped, kept = asyncio.run(main())
    assert waited and stepped
    alone = _runs(engine, [1, 25])[-1]
    alone.compute(25)
    assert kept.last_logits is not None and alone.last_logits is not None
    assert torch.equal(kept.last_logits, alone.last_logits)
