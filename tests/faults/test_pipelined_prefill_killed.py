"""Pipelined transfer: a prefill SIGKILLed between two manifest parts, seen from decode.

Real processes, real NIXL, reference engine, --prefill-chunk-tokens. The TEST-ONLY pause hook
(HYBRID_PD_TEST_PAUSE `between_parts`) holds the prefill after its first part left (pinned, the
part's READ posted or done), and it is killed there: decode must fail the request with
UNAVAILABLE naming the peer and free everything it held for it, the blocks the first part was
READ into included, with no READ handle left; a restarted prefill serves the next request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.faults.harness import Outcome, Service, free_port, generate, start

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]

PREFILL_ID = "pipelined-prefill"
REFERENCE = ["--engine", "reference"]
PREFILL_FLAGS = [
    *REFERENCE, "--engine-id", PREFILL_ID, "--num-blocks", "64", "--prefill-chunk-tokens", "20",
    "--heartbeat-seconds", "0.5", "--lease-seconds", "2",
]  # fmt: skip
DECODE_FLAGS = [*REFERENCE, "--engine-id", "pipelined-decode", "--num-blocks", "64", "--read-timeout-seconds", "5"]
PROMPT = list(range(32, 132))  # 100 tokens: parts [0, 32), [32, 64), [64, 99)


@pytest.fixture
def services() -> Iterator[tuple[int, list[Service]]]:
    port = free_port()
    started: list[Service] = []
    try:
        yield port, started
    finally:
        for service in started:
            service.kill()


async def kill_between_parts(
    port: int, started: list[Service], prefill: Service, decode: Service, request_id: str, prompt: list[int], blocks_kept: int
) -> tuple[Outcome, Service]:
    """Generate `request_id`, SIGKILL the prefill while it holds the request between two parts
    (pinned at a part), and check decode fails it with UNAVAILABLE and frees every block but
    `blocks_kept`, every READ handle and the request. Then restart the prefill on `port`; decode
    serves again. Returns decode's answer and the restarted prefill."""
    call = asyncio.ensure_future(generate(decode.address, request_id, prompt, 4))
    await prefill.wait_line(f"TEST PAUSE between_parts {request_id}", timeout=30)
    await prefill.wait_metric("hybrid_pd_pinned_requests", lambda v: v == 1)  # pinned at its first part
    prefill.kill()
    outcome = await call
    assert outcome.status == "UNAVAILABLE", outcome
    await decode.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == blocks_kept)
    await decode.wait_metric("hybrid_pd_open_read_handles", lambda v: v == 0)
    await decode.wait_metric("hybrid_pd_requests_in_flight", lambda v: v == 0)

    restarted = start("prefill", *PREFILL_FLAGS, "--port", str(port))
    started.append(restarted)
    await decode.wait_serving()
    return outcome, restarted


def start_pair(port: int, started: list[Service], *decode_flags: str) -> tuple[Service, Service]:
    """A prefill that pauses between the parts of every `midway-` request, and its decode."""
    prefill = start("prefill", *PREFILL_FLAGS, "--port", str(port), pauses="between_parts:30:midway-")
    started.append(prefill)
    decode = start("decode", *DECODE_FLAGS, *decode_flags, "--prefill", f"127.0.0.1:{port}")
    started.append(decode)
    return prefill, decode


async def test_prefill_killed_between_parts_fails_cleanly(services: tuple[int, list[Service]]) -> None:
    port, started = services
    prefill, decode = start_pair(port, started)
    await decode.wait_serving()
    outcome, restarted = await kill_between_parts(port, started, prefill, decode, "midway-1", PROMPT, blocks_kept=0)
    assert PREFILL_ID in outcome.message and f"127.0.0.1:{port}" in outcome.message, outcome
    ok = await generate(decode.address, "after-1", PROMPT, 4)
    assert ok.status == "OK" and len(ok.tokens) == 4 and ok.summary is not None, ok
    assert ok.summary.transfer.read_count == 3  # three parts, one READ each
    await restarted.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)


async def test_prefill_killed_between_parts_after_a_cached_prefix_keeps_only_the_cache(
    services: tuple[int, list[Service]],
) -> None:
    """Decode's prefix cache on: the next turn's parts start after the cached prefix, and the
    prefill dies between them. Decode frees every block of the request (the cached ones stay the
    cache's, untouched), and the restarted prefill serves the turn again from the same prefix."""
    port, started = services
    prefill, decode = start_pair(port, started, "--prefix-cache-blocks", "16", "--prefix-cache-states", "0")
    await decode.wait_serving()
    first = await generate(decode.address, "turn-1", PROMPT, 4)
    assert first.status == "OK" and first.summary is not None, first
    await decode.wait_metric("hybrid_pd_requests_in_flight", lambda v: v == 0)
    cached_blocks = 99 // 32  # turn 1's full decode blocks of its 99 computed tokens, now the cache's
    await decode.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == cached_blocks)
    turn = [*PROMPT, *first.tokens, *range(140, 196)]  # 160 tokens: parts [96, 128), [128, 159)
    _, restarted = await kill_between_parts(port, started, prefill, decode, "midway-2", turn, blocks_kept=cached_blocks)
    ok = await generate(decode.address, "turn-2", turn, 4)
    assert ok.status == "OK" and len(ok.tokens) == 4 and ok.summary is not None, ok
    assert ok.summary.prefix_cached_tokens == 96 and ok.summary.digests_verified
    assert ok.summary.transfer.read_count == 2  # the two parts after the prefix, one READ each
    await restarted.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
