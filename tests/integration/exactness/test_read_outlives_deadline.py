"""No READ outlives its blocks: a READ that times out while its handle is still in flight keeps
the request's blocks (decode's, and prefill's pin) until NIXL has released the handle; the next
request that needs those blocks waits for them and is exact.

A real DRAM READ finishes inside its post, and on a real network a cancel is immediate, so the
condition "in flight past its deadline and not cancellable yet" cannot be produced on demand:
the decode agent's TEST-ONLY hold (RankAgent.test_hold_seconds) keeps the READ in flight and
uncancellable for HOLD_SECONDS, then lands its bytes again, as a late transfer would.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from shared.engine.reference.colocated import colocated_generate
from shared.layout.page import build_engine_layout
from shared.layout.presets import TINY_PRESETS
from tests.integration.exactness.pair import service_pair
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]

MODEL = "tiny-mamba2"
HOLD_SECONDS = 2.0
READ_TIMEOUT_SECONDS = 0.3
PROMPT_A = list(b"the held request")
PROMPT_B = list(b"the next one, intact")
MAX_TOKENS = 6


def blocks_for_one_request(tokens: int) -> int:
    layout = build_engine_layout(TINY_PRESETS[MODEL], 1)
    return sum(math.ceil(tokens / layout.block_size) if g.kind == "attention" else 1 for g in layout.groups)


async def test_a_timed_out_read_keeps_its_blocks_until_released() -> None:
    need = blocks_for_one_request(len(PROMPT_B) + MAX_TOKENS)
    assert need == blocks_for_one_request(len(PROMPT_A) + MAX_TOKENS)
    flags = ["--read-timeout-seconds", str(READ_TIMEOUT_SECONDS), "--check-state"]
    async with service_pair(MODEL, 1, 1, num_blocks=need, extra_decode=flags) as pair:
        decode, prefill = pair.decode.host, pair.prefill.host
        agent = decode.agents[0]
        agent.test_hold_seconds = HOLD_SECONDS
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await pair.generate(PROMPT_A, MAX_TOKENS)
        failed_after = loop.time() - started
        agent.test_hold_seconds = 0.0
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "timed out" in (failed.value.details() or "")
        assert failed_after < HOLD_SECONDS, "the client waited for the release; it should get its error at once"

        # The READ is still in flight: its blocks stay allocated on both sides.
        assert agent.live_xfers == 1
        assert decode.allocator.num_used == need
        assert len(pair.prefill.pins) == 1 and prefill.allocator.num_used > 0

        # The next request needs the same blocks: it waits for the release, then is exact.
        following = asyncio.ensure_future(pair.generate(PROMPT_B, MAX_TOKENS))
        await asyncio.sleep(HOLD_SECONDS / 4)
        assert not following.done() and decode.allocator.num_used == need
        got = await following
        assert loop.time() - started >= HOLD_SECONDS
        assert got.summary.state_verified
        assert got.token_ids == colocated_generate(TINY_PRESETS[MODEL], PROMPT_B, MAX_TOKENS)

        await until(
            lambda: decode.allocator.num_used == 0 and prefill.allocator.num_used == 0 and agent.live_xfers == 0, timeout=10
        )
        assert len(pair.prefill.pins) == 0
