"""Leases, heartbeats, release, cancellation and drain: blocks never stranded, never freed early."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import grpc
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.errors import Unavailable
from shared.rpc.status import describe

stamp = sys.modules["services_stamp_engine"]  # loaded by conftest.py

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def until(condition: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


class RawSession:
    """The test plays decode on the Session stream (handshake with a real decode's layout)."""

    def __init__(self, channel: grpc.aio.Channel, decode_layout: Any) -> None:
        self.stub = pb_grpc.PrefillServiceStub(channel)
        self.layout = decode_layout
        self.call: Any = None

    async def open(self) -> pb.SessionReady:
        answer = await self.stub.Handshake(pb.HandshakeRequest(layout=self.layout), timeout=10)
        self.call = self.stub.Session()
        await self.call.write(
            pb.SessionRequest(
                hello=pb.SessionHello(
                    decode_engine_id=self.layout.engine_id,
                    decode_incarnation=self.layout.incarnation,
                    prefill_incarnation=answer.layout.incarnation,
                    readers_per_prefill_rank=[1] * answer.layout.tp_size,
                )
            )
        )
        first = await self.call.read()
        assert first.WhichOneof("payload") == "ready"
        return first.ready

    async def send(self, **payload: Any) -> None:
        await self.call.write(pb.SessionRequest(**payload))

    async def next(self, kind: str) -> Any:
        while True:
            msg = await asyncio.wait_for(self.call.read(), 10)
            if msg.WhichOneof("payload") == kind:
                return getattr(msg, kind)


async def test_lease_expiry_frees_unread_blocks(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill("--lease-seconds", "0.4")
    decode = await start_decode(prefill.port, ready=False)
    session = RawSession(channel_to(prefill.port), decode.host.message)
    ready = await session.open()
    assert ready.lease_duration.ToMilliseconds() == 400
    await session.send(job=pb.PrefillJob(request_id="lonely", prompt_token_ids=[1, 2, 3, 4]))
    manifest = await session.next("manifest")
    assert manifest.num_computed_tokens == 3 and manifest.prompt_token_count == 4
    assert prefill.host.allocator.num_used > 0
    started = time.monotonic()
    await until(lambda: prefill.host.allocator.num_used == 0)
    assert time.monotonic() - started < 2.0
    assert prefill.pins.ended["lease_expired"] == 1


async def test_heartbeats_renew_and_release_frees(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill("--lease-seconds", "0.4")
    decode = await start_decode(prefill.port, ready=False)
    session = RawSession(channel_to(prefill.port), decode.host.message)
    await session.open()
    await session.send(job=pb.PrefillJob(request_id="kept", prompt_token_ids=[9, 8, 7]))
    await session.next("manifest")
    for _ in range(8):  # 1.2 s, three leases long
        await session.send(heartbeat=pb.DecodeHeartbeat(request_ids=["kept"]))
        await asyncio.sleep(0.15)
    assert prefill.host.allocator.num_used > 0 and not prefill.pins.ended
    await session.send(release=pb.ReleaseBlocks(request_id="kept", reason="test"))
    await until(lambda: prefill.host.allocator.num_used == 0)
    assert prefill.pins.ended["released"] == 1


async def test_bad_job_fails_in_band_and_session_lives(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    session = RawSession(channel_to(prefill.port), decode.host.message)
    await session.open()
    await session.send(job=pb.PrefillJob(request_id="bad", prompt_token_ids=[]))
    failure = await session.next("failure")
    assert failure.request_id == "bad" and failure.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert failure.message.startswith("job.prompt_token_ids")
    await session.send(job=pb.PrefillJob(request_id="good", prompt_token_ids=[1, 2]))
    assert (await session.next("manifest")).request_id == "good"


class SlowStamp(stamp.StampEngine):  # type: ignore[misc, name-defined]
    """FAKE: prefill and decode steps take a while, so a test can act in the middle."""

    prefill_seconds = 0.3
    step_seconds = 0.02

    def prefill(self, prompt: Any, blocks: Any) -> None:
        time.sleep(self.prefill_seconds)
        super().prefill(prompt, blocks)

    def start_decode(self, prompt: Any, num_computed: int, blocks: Any, ensure: Any) -> Any:
        session = super().start_decode(prompt, num_computed, blocks, ensure)
        step = session.step

        def slow_step() -> int:
            time.sleep(self.step_seconds)
            return int(step())

        session.step = slow_step
        return session


async def test_client_cancel_frees_both_sides(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill(engine=SlowStamp)
    decode = await start_decode(prefill.port, engine=SlowStamp)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    # Cancelled while prefill computes, then while decode generates.
    for cancel_after_chunks in (None, 1):
        call = stub.Generate(dpb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_tokens=200), timeout=30)
        if cancel_after_chunks is None:
            await asyncio.sleep(0.1)
        else:
            for _ in range(cancel_after_chunks):
                await call.read()
        call.cancel()
        await until(lambda: prefill.host.allocator.num_used == 0 and decode.host.allocator.num_used == 0)
    assert not prefill.pins.ended["lease_expired"]


async def test_drain_finishes_in_flight_and_refuses_new(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, "--drain-seconds", "10", engine=SlowStamp)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    call = stub.Generate(dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=40), timeout=30)
    first = await call.read()
    assert first.WhichOneof("payload") == "chunk"
    stopping = asyncio.ensure_future(decode.stop())
    await until(lambda: decode.shell.lifecycle.draining.is_set())
    late = channel_to(decode.port)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in dpb_grpc.DecodeServiceStub(late).Generate(dpb.GenerateRequest(prompt_token_ids=[1], max_tokens=1), timeout=5):
            pass
    assert describe(err.value).status == "UNAVAILABLE"
    tokens = list(first.chunk.token_ids)
    while (response := await call.read()) is not grpc.aio.EOF:
        tokens += response.chunk.token_ids
    assert tokens == stamp.expected_tokens([1, 2, 3], 40, decode.host.spec.vocab_size)
    assert await call.code() == grpc.StatusCode.OK
    await stopping


async def test_prefill_drain_tells_sessions_and_decode_goes_not_ready(start_prefill: Any, start_decode: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    await asyncio.wait_for(prefill.stop(), 10)  # returns early: the idle session ends itself
    await until(lambda: not decode.peers.any_ready)
    with pytest.raises(Unavailable, match="no prefill engine is ready"):
        decode.peers.pick()


async def test_second_hello_ends_the_session_with_a_status(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    session = RawSession(channel_to(prefill.port), decode.host.message)
    await session.open()
    await session.send(hello=pb.SessionHello(decode_engine_id="again"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await session.next("manifest")
    assert describe(err.value).status == "FAILED_PRECONDITION"
    assert describe(err.value).fields == ("hello",)
