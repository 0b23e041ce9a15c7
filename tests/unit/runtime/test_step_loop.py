"""The decode step loop (shared/runtime/step_loop.py) over the real reference engine on paged
caches: every running request takes part in each step, joins at the next step, streams one
token per step, and leaves (finished, deadline, failure, gone) without disturbing the others;
the tokens equal the colocated run throughout.

Two stand-ins, named as such: `StepCounting` wraps the reference engine to offer `step_batch`
(to observe which sessions share a step; the reference engine itself steps per session), and
`FailingSession` fails a real session's step on demand (no real engine fails a step on cue)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.engine.protocol import BatchedDecode, DecodeSession, RequestBlocks
from shared.engine.reference.colocated import colocated_generate
from shared.engine.reference_engine import ReferenceEngine
from shared.engine.stopping import StopRule
from shared.errors import DeadlineExceeded, ResourceExhausted
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.presets import TINY_PRESETS
from shared.runtime.compute_thread import ComputeThread
from shared.runtime.step_loop import AlwaysRoom, Member, StepLoop

pytestmark = pytest.mark.asyncio

MODEL = "tiny-mamba2"


@dataclass
class Engines:
    layout: EngineLayout
    engine: ReferenceEngine
    next_block: int = 1

    def blocks(self, tokens: int) -> RequestBlocks:
        """Fresh blocks for `tokens` tokens: attention runs, one block per Mamba group."""
        n = -(-tokens // self.layout.block_size)
        ids = []
        for group in self.layout.groups:
            count = n if group.kind == "attention" else 1
            ids.append(np.arange(self.next_block, self.next_block + count))
            self.next_block += count
        return RequestBlocks(f"r{self.next_block}", ids)

    def start(self, prompt: Sequence[int], max_tokens: int) -> DecodeSession:
        blocks = self.blocks(len(prompt) + max_tokens)
        self.engine.prefill(prompt, blocks)
        return self.engine.start_decode(prompt, self.engine.num_prefill_tokens(len(prompt)), blocks, lambda _: blocks)


def engines(num_blocks: int = 256) -> Engines:
    layout = build_engine_layout(TINY_PRESETS[MODEL], 1)
    ranks = [RankViews(layout, RankCache(layout.num_regions, num_blocks, layout.page_bytes))]
    return Engines(layout, ReferenceEngine(layout, ranks))


@dataclass
class StepCounting:
    """Stand-in: the reference engine with a `step_batch` that records each step's batch."""

    inner: ReferenceEngine
    batches: list[int] = field(default_factory=list)

    def step_batch(self, sessions: Sequence[DecodeSession]) -> list[int]:
        self.batches.append(len(sessions))
        return [s.step() for s in sessions]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class FailingSession:
    """Stand-in: a real session whose step `fail_at` (0-based) raises."""

    def __init__(self, inner: DecodeSession, fail_at: int) -> None:
        self.inner, self.fail_at, self.steps = inner, fail_at, 0

    def step(self) -> int:
        self.steps += 1
        if self.steps > self.fail_at:
            raise RuntimeError("the engine failed this request's step")
        return self.inner.step()


def prompt_of(i: int) -> list[int]:
    return [(7 * i + j) % 200 + 20 for j in range(5 + 3 * i)]


async def collect(member: Member) -> list[int]:
    return [t.token_id async for t in member.tokens()]


def far() -> float:
    return asyncio.get_running_loop().time() + 60


async def test_concurrent_requests_share_every_step_and_equal_colocated() -> None:
    e = engines()
    counting = StepCounting(e.engine)
    assert isinstance(counting, BatchedDecode)
    compute = ComputeThread("steps")
    loop = StepLoop(counting, compute.submit)  # type: ignore[arg-type]
    try:
        lengths = [3, 9, 6, 12, 1]
        members = [loop.join(e.start(prompt_of(i), n), StopRule(n), far(), AlwaysRoom()) for i, n in enumerate(lengths)]
        got = await asyncio.gather(*(collect(m) for m in members))
    finally:
        compute.shutdown(wait=True)
    for i, (n, tokens) in enumerate(zip(lengths, got)):
        assert tokens == colocated_generate(TINY_PRESETS[MODEL], prompt_of(i), n)
    # All five in the first step, then fewer as each one's max_tokens ends it.
    assert counting.batches == [5, 4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1]
    assert loop.running == 0 and loop.largest_batch == 5


async def test_a_request_joins_at_the_next_step_and_streams_one_token_per_step() -> None:
    e = engines()
    counting = StepCounting(e.engine)
    compute = ComputeThread("steps")
    loop = StepLoop(counting, compute.submit)  # type: ignore[arg-type]
    try:
        first = loop.join(e.start(prompt_of(1), 8), StopRule(8), far(), AlwaysRoom())
        seen: list[tuple[int, int]] = []
        second_tokens: list[int] = []
        async for token in first.tokens():
            seen.append((token.token_id, token.batch_size))
            if len(seen) == 3:  # the second request joins while the first runs
                second = loop.join(e.start(prompt_of(2), 2), StopRule(2), far(), AlwaysRoom())
                collecting = asyncio.ensure_future(collect(second))
        second_tokens = await collecting
    finally:
        compute.shutdown(wait=True)
    assert [t for t, _ in seen] == colocated_generate(TINY_PRESETS[MODEL], prompt_of(1), 8)
    assert second_tokens == colocated_generate(TINY_PRESETS[MODEL], prompt_of(2), 2)
    assert max(b for _, b in seen) == 2 and seen[0][1] == 1 and seen[-1][1] == 1
    assert max(counting.batches) == 2


async def test_a_failing_session_fails_alone() -> None:
    e = engines()
    compute = ComputeThread("steps")
    loop = StepLoop(e.engine, compute.submit)
    try:
        bad = loop.join(FailingSession(e.start(prompt_of(1), 6), fail_at=2), StopRule(6), far(), AlwaysRoom())
        good = loop.join(e.start(prompt_of(2), 6), StopRule(6), far(), AlwaysRoom())
        got_good = asyncio.ensure_future(collect(good))
        got_bad: list[int] = []
        with pytest.raises(RuntimeError, match="failed this request's step"):
            async for token in bad.tokens():
                got_bad.append(token.token_id)
        assert got_bad == colocated_generate(TINY_PRESETS[MODEL], prompt_of(1), 2)
        assert await got_good == colocated_generate(TINY_PRESETS[MODEL], prompt_of(2), 6)
    finally:
        compute.shutdown(wait=True)


async def test_a_passed_deadline_ends_that_request_only() -> None:
    e = engines()
    compute = ComputeThread("steps")
    loop = StepLoop(e.engine, compute.submit)
    try:
        now = asyncio.get_running_loop().time()
        late = loop.join(e.start(prompt_of(1), 50), StopRule(50), now - 1, AlwaysRoom())
        ok = loop.join(e.start(prompt_of(2), 4), StopRule(4), far(), AlwaysRoom())
        with pytest.raises(DeadlineExceeded, match="after 0 of 50 tokens"):
            await collect(late)
        assert await collect(ok) == colocated_generate(TINY_PRESETS[MODEL], prompt_of(2), 4)
    finally:
        compute.shutdown(wait=True)


class GatedRoom:
    """Room that is full until `free` is set; `room_for` waits for it (as a full cache waits
    for frees), or fails when `refuse` is set."""

    def __init__(self, refuse: bool = False) -> None:
        self.free = asyncio.Event()
        self.refuse = refuse
        self.asked = 0

    def try_room(self, steps: int) -> bool:
        return self.free.is_set()

    async def room_for(self, steps: int, deadline: float) -> int:
        self.asked += 1
        if self.refuse:
            raise ResourceExhausted("no cache blocks to grow this request", reason="CACHE_FULL")
        await self.free.wait()
        return steps


async def test_a_request_waiting_for_blocks_sits_out_while_the_others_step() -> None:
    e = engines()
    counting = StepCounting(e.engine)
    compute = ComputeThread("steps")
    loop = StepLoop(counting, compute.submit)  # type: ignore[arg-type]
    room = GatedRoom()
    try:
        waiting = loop.join(e.start(prompt_of(1), 5), StopRule(5), far(), room)
        running = loop.join(e.start(prompt_of(2), 6), StopRule(6), far(), AlwaysRoom())
        waiting_tokens = asyncio.ensure_future(collect(waiting))
        assert await collect(running) == colocated_generate(TINY_PRESETS[MODEL], prompt_of(2), 6)
        assert not waiting_tokens.done() and room.asked == 1
        assert counting.batches == [1] * 6  # it took no step while full
        room.free.set()
        assert await waiting_tokens == colocated_generate(TINY_PRESETS[MODEL], prompt_of(1), 5)
    finally:
        compute.shutdown(wait=True)


async def test_a_request_the_full_cache_cannot_grow_fails_resource_exhausted() -> None:
    e = engines()
    compute = ComputeThread("steps")
    loop = StepLoop(e.engine, compute.submit)
    try:
        stuck = loop.join(e.start(prompt_of(1), 5), StopRule(5), far(), GatedRoom(refuse=True))
        fine = loop.join(e.start(prompt_of(2), 3), StopRule(3), far(), AlwaysRoom())
        with pytest.raises(ResourceExhausted, match="no cache blocks"):
            await collect(stuck)
        assert await collect(fine) == colocated_generate(TINY_PRESETS[MODEL], prompt_of(2), 3)
        assert loop.running == 0
    finally:
        compute.shutdown(wait=True)


async def test_a_request_that_leaves_mid_step_gets_no_token_and_says_when_its_step_ends() -> None:
    e = engines()
    compute = ComputeThread("steps")
    loop = StepLoop(e.engine, compute.submit)
    try:
        gone = loop.join(e.start(prompt_of(1), 20), StopRule(20), far(), AlwaysRoom())
        stays = loop.join(e.start(prompt_of(2), 8), StopRule(8), far(), AlwaysRoom())
        async for _ in gone.tokens():
            break  # the consumer goes away after its first token
        loop.leave(gone)
        assert gone.last_step is not None
        await asyncio.gather(gone.last_step, return_exceptions=True)
        assert await collect(stays) == colocated_generate(TINY_PRESETS[MODEL], prompt_of(2), 8)
        assert loop.running == 0
    finally:
        compute.shutdown(wait=True)
