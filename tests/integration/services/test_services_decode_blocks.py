"""On-demand decode blocks through the real services (reference engine, real NIXL READs): decode
admits a request with blocks for its prompt and first step, grows them as the sequence crosses
block boundaries, and a request that cannot grow waits for blocks within its deadline, then
fails RESOURCE_EXHAUSTED while the others carry on; tokens equal the colocated run throughout.

Requests end early through stop_token_ids (the reference models have no EOS), so a large
max_tokens is allowed but never generated: exactly the case an up-front reservation wasted."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import pytest

from shared.engine.reference.colocated import colocated_generate
from shared.layout.presets import TINY_PRESETS
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.runtime.engine_host import EngineHost
from tests.decode_stream import settled
from tests.integration.exactness.pair import service_pair
from tests.integration.metrics.test_metrics import scrape
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]

MODEL = "tiny-mamba2"  # decode blocks of 32 tokens: 2 Mamba groups + 1 attention group


def prompt_of(length: int, start: int = 40) -> list[int]:
    return list(range(start, start + length))


@cache
def colocated(prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tuple(colocated_generate(TINY_PRESETS[MODEL], list(prompt), max_tokens))


def stopping_at(prompt: list[int], at_least: int) -> tuple[int, list[int]]:
    """(stop id, expected tokens): the first colocated token at index >= `at_least` not seen
    before, so generation ends there, after exactly len(expected) tokens."""
    tokens = colocated(tuple(prompt), at_least + 64)
    i = next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])
    return tokens[i], list(tokens[: i + 1])


def request(prompt: list[int], max_tokens: int, stop: Sequence[int] = ()) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, stop_token_ids=list(stop))


def blocks_for(host: EngineHost, num_tokens: int) -> int:
    return sum(host.blocks_per_group(num_tokens))


@contextmanager
def peak_blocks(host: EngineHost) -> Iterator[list[int]]:
    """The most blocks the decode allocator held at once while inside (observes the real one)."""
    allocator, peak = host.allocator, [0]
    allocate = allocator.allocate

    def observed(request_id: str, n: int, **kw: Any) -> Any:
        ids = allocate(request_id, n, **kw)
        peak[0] = max(peak[0], allocator.num_used)
        return ids

    allocator.allocate = observed  # type: ignore[method-assign]
    try:
        yield peak
    finally:
        allocator.allocate = allocate  # type: ignore[method-assign]


async def test_large_max_tokens_reserves_what_it_uses() -> None:
    async with service_pair(MODEL, 1, 1, num_blocks=96) as pair:
        host = pair.decode.host
        prompt = prompt_of(20)
        stop, expected = stopping_at(prompt, 40)  # decoding crosses the 32-token block boundary
        max_tokens = host.max_tokens() - len(prompt)  # the whole cache, if it were reserved up front
        assert blocks_for(host, len(prompt) + max_tokens) == host.num_blocks
        with peak_blocks(host) as peak:
            got = await settled(pair.stub, request(prompt, max_tokens, [stop]), timeout=60)
        assert got.failure is None and got.tokens == expected
        assert got.summary_or_empty().finish_reason == pb.FINISH_REASON_STOP
        written = len(prompt) + len(expected) - 1  # the last token is never fed back
        # What the sequence used, plus at most one step taken ahead: a few blocks, not the cache.
        assert blocks_for(host, written) <= peak[0] <= blocks_for(host, written + 1)
        assert peak[0] <= 5 < host.num_blocks
        await until(lambda: host.allocator.num_used == 0, timeout=30)


async def test_two_requests_fit_at_their_actual_lengths() -> None:
    # 12 blocks: either request at its max_tokens takes all of them; at their real lengths
    # (about 60 tokens: 2 attention blocks + 2 Mamba each) both fit side by side.
    async with service_pair(MODEL, 1, 1, num_blocks=12) as pair:
        host = pair.decode.host
        prompts = [prompt_of(20, 40), prompt_of(25, 90)]
        stops = [stopping_at(p, 36) for p in prompts]
        max_tokens = [host.max_tokens() - len(p) for p in prompts]
        assert all(blocks_for(host, len(p) + m) == host.num_blocks for p, m in zip(prompts, max_tokens))
        with peak_blocks(host) as peak:
            got = await asyncio.gather(
                *(settled(pair.stub, request(p, m, [s]), timeout=60) for p, m, (s, _) in zip(prompts, max_tokens, stops))
            )
        for outcome, (_, expected) in zip(got, stops):
            assert outcome.failure is None and outcome.tokens == expected
        # An up-front reservation would have held all 12 for one request and queued the other.
        assert peak[0] < host.num_blocks
        await until(lambda: host.allocator.num_used == 0, timeout=30)


async def test_a_request_that_cannot_grow_waits_then_fails_while_another_completes() -> None:
    flags = ["--metrics-port", "0"]
    async with service_pair(MODEL, 1, 1, num_blocks=16, extra_decode=flags) as pair:
        host = pair.decode.host
        short, long = prompt_of(5, 30), prompt_of(20, 60)
        short_expected = list(colocated(tuple(short), 20))  # 24 tokens written: its first block
        admitted = blocks_for(host, len(short) + 1) + blocks_for(host, len(long) + 1)
        assert admitted == 6 and blocks_for(host, len(short) + 20) == blocks_for(host, len(short) + 1)
        # Other holders have the rest of the cache (taken from the real allocator, never freed
        # during the test): the two requests share 6 blocks, and `long` needs 9 to finish.
        held = host.allocator.allocate("other-holders", host.num_blocks - admitted)
        finishing = asyncio.ensure_future(settled(pair.stub, request(short, 20), timeout=60))
        await until(lambda: host.allocator.num_used == held.size + blocks_for(host, len(short) + 1), timeout=30)
        stuck = asyncio.ensure_future(settled(pair.stub, request(long, 200), timeout=5))
        # `short` never needs more than its admission blocks: it completes whenever it runs.
        done = await finishing
        assert (
            done.failure is None
            and done.tokens == short_expected
            and done.summary_or_empty().finish_reason == pb.FINISH_REASON_LENGTH
        )
        # `long` grows into every block there is, then waits (visible in the metrics) until its deadline.
        await until(lambda: host.waiting_for_blocks == 1, timeout=30)
        assert scrape(pair.decode.shell.metrics_port)["hybrid_pd_requests_queued_for_blocks"] == 1
        failed = await stuck
        assert failed.failure is not None and failed.failure.status == "RESOURCE_EXHAUSTED", failed
        assert failed.failure.reason == "CACHE_FULL"
        assert "grow this request past" in failed.failure.message and "cache full" in failed.failure.message
        # What it streamed before it stopped is the colocated run's beginning, past its first block.
        assert len(failed.tokens) > 32 - len(long)
        assert failed.tokens == list(colocated(tuple(long), 200))[: len(failed.tokens)]
        # Its blocks are free again: only the other holders' remain.
        await until(lambda: host.allocator.num_used == held.size, timeout=30)
        assert host.waiting_for_blocks == 0
        assert scrape(pair.decode.shell.metrics_port)["hybrid_pd_requests_queued_for_blocks"] == 0
        host.free("other-holders")
