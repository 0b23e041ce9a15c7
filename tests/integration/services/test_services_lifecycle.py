"""Leases, heartbeats, release, cancellation and drain: blocks never stranded, never freed early."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from shared.errors import Unavailable
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.pb.hybridpd.v1 import layout_pb2 as lpb
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.status import code_number, describe
from shared.runtime.faults import FaultPlan, Injector, Pause
from tests.integration.services import stamp_engine as stamp
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


class RawSession:
    """The test plays decode on the Session stream (handshake with a real decode's layout)."""

    def __init__(self, channel: grpc.aio.Channel, decode_layout: Any, *, incarnation: int | None = None) -> None:
        self.stub = pb_grpc.PrefillServiceStub(channel)
        self.layout = lpb.EngineLayout()
        self.layout.CopyFrom(decode_layout)
        if incarnation is not None:  # the same decode engine, restarted
            self.layout.incarnation = incarnation
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


async def test_a_job_with_a_bad_sampling_value_fails_naming_the_field(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    session = RawSession(channel_to(prefill.port), decode.host.message)
    await session.open()
    bad = pb.JobSampling(temperature=1.0, top_p=0.0)
    await session.send(job=pb.PrefillJob(request_id="bad", prompt_token_ids=[1, 2], sampling=bad))
    failure = await session.next("failure")
    assert failure.request_id == "bad" and failure.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert failure.message.startswith("job.sampling.top_p"), failure.message
    # Negative control: the same job with a valid top_p runs.
    good = pb.JobSampling(temperature=1.0, top_p=1.0)
    await session.send(job=pb.PrefillJob(request_id="bad", prompt_token_ids=[1, 2], sampling=good))
    assert (await session.next("manifest")).request_id == "bad"  # the failed id was not left in flight


async def test_a_job_whose_masked_ids_are_bad_fails_naming_the_field(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    session = RawSession(channel_to(prefill.port), decode.host.message)
    await session.open()
    vocab = prefill.host.spec.vocab_size
    cases = {
        "outside": ([3, vocab], "the vocabulary"),
        "all": (range(vocab), "no token is left"),
    }
    for name, (ids, says) in cases.items():
        sampling = pb.JobSampling(top_p=1.0, min_tokens=1, stop_token_ids=ids)
        await session.send(job=pb.PrefillJob(request_id=name, prompt_token_ids=[1, 2], sampling=sampling))
        failure = await session.next("failure")
        assert failure.request_id == name and failure.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert failure.message.startswith("job.sampling.stop_token_ids") and says in failure.message, failure.message
    assert prefill.host.allocator.num_used == 0
    # Negative control: one id left unmasked is a valid job.
    ok = pb.JobSampling(top_p=1.0, min_tokens=1, stop_token_ids=range(vocab - 1))
    await session.send(job=pb.PrefillJob(request_id="ok", prompt_token_ids=[1, 2], sampling=ok))
    assert (await session.next("manifest")).request_id == "ok"


SlowStamp = stamp.SlowStamp


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


async def test_a_job_cancelled_as_its_manifest_arrives_is_freed_on_prefill(
    start_prefill: Any, start_decode: Any, inject_faults: Callable[[Injector], None]
) -> None:
    """The race a soak found: the manifest resolves the job's future and, in the same loop turn,
    the waiting task is cancelled, so the caller never sees the manifest and never releases it.
    The session must cancel the job itself; it must not keep heartbeating its lease (renewed
    forever, the blocks would never be freed). Forced here, not left to timing: the cancel is
    issued right after the manifest is delivered, before the waiting task runs again."""
    prefill = await start_prefill("--lease-seconds", "60", "--heartbeat-seconds", "0.2")
    decode = await start_decode(prefill.port)  # heartbeats at the interval prefill announces
    session = decode.peers.pick().session
    delivered = asyncio.Event()
    submit = asyncio.ensure_future(session.submit("raced", [1, 2, 3, 4], 10.0))

    class CancelOnDelivery(Injector):  # the cancel lands in the manifest's loop turn
        def manifest_delivered(self, request_id: str) -> None:
            if request_id == "raced":
                submit.cancel()
                delivered.set()

    inject_faults(CancelOnDelivery())
    await asyncio.wait_for(delivered.wait(), 10)
    with pytest.raises(asyncio.CancelledError):
        await submit
    await until(lambda: prefill.host.allocator.num_used == 0)  # at once, not at the lease's end
    assert session.in_flight == 0
    assert not prefill.pins.ended["lease_expired"]


async def test_a_generate_cancelled_as_its_manifest_arrives_frees_both_sides(
    start_prefill: Any, start_decode: Any, channel_to: Any, inject_faults: Callable[[Injector], None]
) -> None:
    """The same race one level up, through a real Generate: the request's own task (the one that
    submitted the job) is cancelled in the loop turn its manifest is delivered. Whatever waits
    between the two (a second task, a wrapper) must not lose the manifest: the job is cancelled
    or released on prefill at once, and its lease is not heartbeated on forever."""
    prefill = await start_prefill("--lease-seconds", "60", "--heartbeat-seconds", "0.2")
    decode = await start_decode(prefill.port)
    session = decode.peers.pick().session
    submit = session.submit
    submitter: list[asyncio.Task[Any]] = []

    def recording_submit(*args: Any, **kw: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        submitter.append(task)
        return submit(*args, **kw)

    class CancelOnDelivery(Injector):  # as above
        def manifest_delivered(self, request_id: str) -> None:
            if submitter:
                submitter[0].cancel()

    session.submit = recording_submit
    inject_faults(CancelOnDelivery())
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    # The handler's task is cancelled under grpc (as a client cancel does): the client sees the
    # call end at its deadline at the latest, so keep that short.
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in stub.Generate(dpb.GenerateRequest(prompt_token_ids=[3, 4, 5, 6], max_tokens=4), timeout=3):
            pass
    assert len(submitter) == 1
    await until(lambda: prefill.host.allocator.num_used == 0 and decode.host.allocator.num_used == 0)
    assert session.in_flight == 0 and not prefill.pins.ended["lease_expired"]


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
        async for _ in dpb_grpc.DecodeServiceStub(late).Generate(
            dpb.GenerateRequest(prompt_token_ids=[1], max_tokens=1), timeout=5
        ):
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


async def test_decode_heartbeats_keep_a_held_request_alive(
    start_prefill: Any, start_decode: Any, channel_to: Any, inject_faults: Callable[[Injector], None]
) -> None:
    """Decode holds a manifest for 2.5 leases before its READ: its heartbeats renew the lease."""
    inject_faults(FaultPlan(pauses=(Pause("before_read", 2.5, "held-"),)))
    prefill = await start_prefill("--lease-seconds", "1", "--heartbeat-seconds", "0.3")
    decode = await start_decode(prefill.port, "--check-state")
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    tokens = []
    async for response in stub.Generate(
        dpb.GenerateRequest(request_id="held-1", prompt_token_ids=[4, 5, 6], max_tokens=4), timeout=20
    ):
        tokens += response.chunk.token_ids
    assert tokens == stamp.expected_tokens([4, 5, 6], 4, decode.host.spec.vocab_size)
    await until(lambda: prefill.host.allocator.num_used == 0)
    assert prefill.pins.ended == {"read": 1}  # never lease_expired


async def test_a_restarted_decode_cannot_touch_its_old_incarnations_pins(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill("--lease-seconds", "1")
    decode = await start_decode(prefill.port, ready=False)
    old = RawSession(channel_to(prefill.port), decode.host.message)
    await old.open()
    await old.send(job=pb.PrefillJob(request_id="r", prompt_token_ids=[1, 2, 3]))
    await old.next("manifest")
    old.call.cancel()  # the old incarnation dies
    new = RawSession(channel_to(prefill.port), decode.host.message, incarnation=decode.host.incarnation + 2)
    await new.open()
    # Same request id: a new request of the new incarnation, not the old pin.
    await new.send(job=pb.PrefillJob(request_id="r", prompt_token_ids=[7, 8, 9]))
    await new.next("manifest")
    assert len(prefill.pins) == 2
    for _ in range(4):  # heartbeats and a release naming "r" only concern the new incarnation's pin
        await new.send(heartbeat=pb.DecodeHeartbeat(request_ids=["r"]))
        await asyncio.sleep(0.4)
    assert prefill.pins.ended == {"lease_expired": 1} and len(prefill.pins) == 1
    await new.send(release=pb.ReleaseBlocks(request_id="r", reason="test"))
    await until(lambda: prefill.host.allocator.num_used == 0)
    assert prefill.pins.ended == {"lease_expired": 1, "released": 1}


async def test_prefill_forgets_a_decode_engine_when_its_session_ends(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill()
    # The decode app only lends its layout: pointed at a port where no prefill listens, it opens
    # no session of its own here (one it opened to this prefill would be counted too, whenever
    # its connection happened to land: the test raced it under load).
    decode = await start_decode(unused_port(), ready=False)
    session = RawSession(channel_to(prefill.port), decode.host.message)
    await session.open()
    await until(lambda: prefill.servicer.peers.open_sessions == 1)
    assert len(prefill.servicer.peers) == 1
    session.call.cancel()
    await until(lambda: prefill.servicer.peers.open_sessions == 0 and len(prefill.servicer.peers) == 0)


async def test_stream_credits_bound_pinned_requests(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill("--max-pinned-requests", "1")
    decode = await start_decode(prefill.port, ready=False)
    session = RawSession(channel_to(prefill.port), decode.host.message)
    ready = await session.open()
    assert ready.max_pinned_requests == 1
    await session.send(job=pb.PrefillJob(request_id="first", prompt_token_ids=[1, 2]))
    await session.next("manifest")
    short = pb.PrefillJob(request_id="no-credit", prompt_token_ids=[3, 4])
    short.timeout.FromMilliseconds(300)
    await session.send(job=short)
    failure = await session.next("failure")
    assert failure.request_id == "no-credit" and failure.status_code == code_number("RESOURCE_EXHAUSTED")
    assert "credits" in failure.message
    patient = pb.PrefillJob(request_id="patient", prompt_token_ids=[5, 6])
    patient.timeout.FromSeconds(10)
    await session.send(job=patient)
    await asyncio.sleep(0.2)
    assert len(prefill.pins) == 1  # still waiting for the credit
    await session.send(release=pb.ReleaseBlocks(request_id="first", reason="test"))
    assert (await session.next("manifest")).request_id == "patient"


async def test_client_deadline_aborts_the_prefill_job(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill(engine=SlowStamp)
    decode = await start_decode(prefill.port, engine=SlowStamp)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(dpb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_tokens=4), timeout=0.15):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The job was cancelled on prefill (no pin ever made), its blocks freed once the compute ended.
    await until(lambda: prefill.host.allocator.num_used == 0 and decode.host.allocator.num_used == 0)
    assert not prefill.pins.ended and len(prefill.pins) == 0


def unused_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_a_stalled_process_does_not_declare_its_peer_dead(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    """Decode's event loop stops for twice the silence limit (as a CPU-starved or stopped process
    would; here by blocking the loop both services share). The prefill said nothing in that time
    only because nothing ran: the session must survive, and requests go on over it."""
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)  # --heartbeat-seconds 1.0: silence limit 1.5 s
    peer = decode.peers.peers[0]
    session = peer.session
    assert session is not None and peer.ready
    time.sleep(3.0)  # the stall: nothing on this loop runs, timers come due late
    await asyncio.sleep(2.0)  # more than a silence limit of normal running after it
    assert peer.session is session and peer.ready, "the session was dropped after our own stall"
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    async for _ in stub.Generate(dpb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_tokens=3), timeout=10):
        pass
