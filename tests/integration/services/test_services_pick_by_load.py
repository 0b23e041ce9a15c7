"""Decode picks a prefill engine by the load it reports on the Session stream: with two real
prefills, one of them holding many blocks pinned for another decode engine that does not read
them, new requests go to the other; once those pins are released (the negative control), the
two alternate again."""

from __future__ import annotations

import itertools
from typing import Any

import grpc
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import layout_pb2 as lpb
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from tests.decode_stream import generated
from tests.integration.services import stamp_engine as stamp
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]

FAST_REPORTS = ("--heartbeat-seconds", "0.2", "--lease-seconds", "60")  # the pins outlive the test
HELD = 5  # requests pinned on the busy prefill, 4 blocks each


async def hold_pins(channel: grpc.aio.Channel, decode_layout: lpb.EngineLayout) -> Any:
    """Another decode engine (the test, on the real stream) that has HELD requests prefilled and
    never reads them: their blocks stay pinned until it releases them."""
    layout = lpb.EngineLayout()
    layout.CopyFrom(decode_layout)
    layout.engine_id, layout.incarnation = "pin-holder", layout.incarnation + 1
    stub = pb_grpc.PrefillServiceStub(channel)
    answer = await stub.Handshake(pb.HandshakeRequest(layout=layout), timeout=10)
    call = stub.Session()
    hello = pb.SessionHello(
        decode_engine_id=layout.engine_id,
        decode_incarnation=layout.incarnation,
        prefill_incarnation=answer.layout.incarnation,
        readers_per_prefill_rank=[1],
    )
    await call.write(pb.SessionRequest(hello=hello))
    assert (await call.read()).WhichOneof("payload") == "ready"
    for i in range(HELD):  # 65 tokens: 64 prefilled, 2 attention + 2 Mamba blocks
        await call.write(pb.SessionRequest(job=pb.PrefillJob(request_id=f"held-{i}", prompt_token_ids=[1] * 65)))
    manifests = 0
    while manifests < HELD:
        manifests += (await call.read()).WhichOneof("payload") == "manifest"
    return call


def reported_pins(decode: Any, port: int) -> int | None:
    peer = next(p for p in decode.peers.peers if p.target.endswith(f":{port}"))
    load = peer.session.load if peer.session is not None else None
    return None if load is None else int(load.pinned_blocks)


async def test_requests_avoid_the_prefill_whose_cache_is_pinned(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    busy = await start_prefill("--engine-id", "busy-prefill", *FAST_REPORTS)
    idle = await start_prefill("--engine-id", "idle-prefill", *FAST_REPORTS)
    decode = await start_decode(busy.port, "--prefill", f"127.0.0.1:{idle.port}")
    await until(lambda: sum(p.ready for p in decode.peers.peers) == 2, timeout=10)
    holder = await hold_pins(channel_to(busy.port), decode.host.message)
    pinned = busy.pins.blocks()
    assert pinned == 4 * HELD
    await until(lambda: reported_pins(decode, busy.port) == pinned, timeout=10)  # the next heartbeat told decode
    channel = channel_to(decode.port)
    vocab = decode.host.spec.vocab_size

    served = []
    for i in range(6):
        await until(lambda: reported_pins(decode, idle.port) == 0, timeout=10)  # our own last request is read
        prompt = [2 + i, 3, 4, 5]
        tokens, summary = await generated(channel, dpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=4), timeout=30)
        assert tokens == stamp.expected_tokens(prompt, 4, vocab)
        served.append(summary.prefill_engine_id)
    assert served == ["idle-prefill"] * 6, served

    # Negative control: the same pair once the pins are gone alternates between the two.
    for i in range(HELD):
        await holder.write(pb.SessionRequest(release=pb.ReleaseBlocks(request_id=f"held-{i}", reason="test")))
    await until(lambda: busy.pins.blocks() == 0 and reported_pins(decode, busy.port) == 0, timeout=10)
    served = []
    for i in range(6):
        await until(lambda: reported_pins(decode, idle.port) == 0 and reported_pins(decode, busy.port) == 0, timeout=10)
        prompt = [2 + i, 3, 4, 5]
        tokens, summary = await generated(channel, dpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=4), timeout=30)
        assert tokens == stamp.expected_tokens(prompt, 4, vocab)
        served.append(summary.prefill_engine_id)
    assert sorted(set(served)) == ["busy-prefill", "idle-prefill"], served
    assert all(a != b for a, b in itertools.pairwise(served)), served  # idle pool: round-robin
    holder.cancel()
    await until(lambda: decode.host.allocator.num_used == 0 and busy.host.allocator.num_used == 0, timeout=10)
    await until(lambda: idle.host.allocator.num_used == 0, timeout=10)
