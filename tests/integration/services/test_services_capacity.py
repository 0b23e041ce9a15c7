"""A full cache queues the request until shortly before its deadline, then RESOURCE_EXHAUSTED;
a request whose deadline allows waits for the blocks and runs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from tests.decode_stream import failure_of, settled
from tests.integration.services import stamp_engine as stamp
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


class SlowerStamp(stamp.SlowStamp):
    """FAKE (see stamp_engine.py): 32 steps take ~2.4 s, as long as the refused request must queue."""

    step_seconds = 0.075


async def test_full_decode_cache_queues_then_refuses(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    # 6 blocks: 2 Mamba + 4 attention blocks of 32 tokens; the hog's prompt and first step (97
    # tokens) take all of them at once, for ~2.4 s (decode blocks grow on demand, so a long
    # prompt, not a long max_tokens, fills the cache at admission).
    decode = await start_decode(prefill.port, "--num-blocks", "6", engine=SlowerStamp)
    channel = channel_to(decode.port)
    hog = asyncio.ensure_future(settled(channel, dpb.GenerateRequest(prompt_token_ids=[1] * 96, max_tokens=32), timeout=30))
    await until(lambda: decode.host.allocator.num_free == 0, timeout=10)
    # Decode takes the hog's blocks before its job reaches prefill: count only after prefill ran it.
    await until(lambda: prefill.host.engine.prefills == 1, timeout=10)
    prefills_before = prefill.host.engine.prefills
    started = time.monotonic()
    refused = await failure_of(channel, dpb.GenerateRequest(prompt_token_ids=[2, 3, 4], max_tokens=4), timeout=1.0)
    assert refused.status == "RESOURCE_EXHAUSTED", refused
    assert refused.reason == "CACHE_FULL" and "cache full" in refused.message
    assert time.monotonic() - started >= 0.5  # it queued, it was not refused at once
    assert prefill.host.engine.prefills == prefills_before  # prefill never saw it
    patient = await settled(channel, dpb.GenerateRequest(prompt_token_ids=[2, 3, 4], max_tokens=4), timeout=30)
    assert patient.failure is None and patient.tokens == stamp.expected_tokens([2, 3, 4], 4, decode.host.spec.vocab_size)
    assert (await hog).failure is None
    await until(lambda: decode.host.allocator.num_used == 0 and prefill.host.allocator.num_used == 0, timeout=10)


async def test_full_prefill_cache_answers_resource_exhausted(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    # 4 blocks: one job of 65 prompt tokens (64 prefilled: 2 attention + 2 Mamba blocks) fills it.
    prefill = await start_prefill("--num-blocks", "4")
    decode = await start_decode(prefill.port)
    stub = pb_grpc.PrefillServiceStub(channel_to(prefill.port))
    answer = await stub.Handshake(pb.HandshakeRequest(layout=decode.host.message), timeout=10)
    holder = stub.Session()
    await holder.write(
        pb.SessionRequest(
            hello=pb.SessionHello(
                decode_engine_id=decode.host.engine_id,
                decode_incarnation=decode.host.incarnation,
                prefill_incarnation=answer.layout.incarnation,
                readers_per_prefill_rank=[1],
            )
        )
    )
    await holder.read()  # ready
    await holder.write(pb.SessionRequest(job=pb.PrefillJob(request_id="hog", prompt_token_ids=[1] * 65)))
    while (await holder.read()).WhichOneof("payload") != "manifest":
        pass
    assert prefill.host.allocator.num_free == 0
    refused = await failure_of(
        channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=2), timeout=1.0
    )
    assert refused.status == "RESOURCE_EXHAUSTED", refused
    assert "prefill test-prefill" in refused.message and "cache full" in refused.message
    await until(lambda: decode.host.allocator.num_used == 0, timeout=10)
    await holder.write(pb.SessionRequest(release=pb.ReleaseBlocks(request_id="hog", reason="test")))
    served = await settled(channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=2), timeout=10)
    assert served.failure is None and served.tokens == stamp.expected_tokens([5, 6, 7], 2, decode.host.spec.vocab_size)
    holder.cancel()
