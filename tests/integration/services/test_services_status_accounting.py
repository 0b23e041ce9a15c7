"""How requests end and are counted: a client deadline is DEADLINE_EXCEEDED (not CANCELLED), a
duplicate in-flight request id is ALREADY_EXISTS, and a request cut by the end of the drain grace
gets our own UNAVAILABLE, not gRPC's "Cancelling all calls"."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.rpc.status import describe
from tests.integration.services import stamp_engine as stamp
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


def finished(app: Any, status: str) -> float:
    return app.metrics.registry.get_sample_value("hybrid_pd_requests_total", {"status": status}) or 0.0


async def test_a_client_deadline_counts_as_deadline_exceeded(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill(engine=stamp.SlowStamp)
    decode = await start_decode(prefill.port, engine=stamp.SlowStamp)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(dpb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_tokens=4), timeout=0.15):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: finished(decode, "DEADLINE_EXCEEDED") == 1, timeout=10)
    assert finished(decode, "CANCELLED") == 0
    # Negative control: a client that cancels before its deadline is CANCELLED.
    call = stub.Generate(dpb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_tokens=200), timeout=30)
    await call.read()
    call.cancel()
    await until(lambda: finished(decode, "CANCELLED") == 1, timeout=10)
    assert finished(decode, "DEADLINE_EXCEEDED") == 1


async def test_a_duplicate_in_flight_request_id_is_already_exists(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, engine=stamp.SlowStamp)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    first = stub.Generate(dpb.GenerateRequest(request_id="twice", prompt_token_ids=[1, 2], max_tokens=200), timeout=30)
    assert (await first.read()).WhichOneof("payload") == "chunk"  # in flight now
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(dpb.GenerateRequest(request_id="twice", prompt_token_ids=[1], max_tokens=1), timeout=10):
            pass
    failure = describe(err.value)
    assert failure.status == "ALREADY_EXISTS" and failure.reason == "ALREADY_EXISTS", failure
    assert failure.message.startswith("request_id: 'twice' is already in flight"), failure
    first.cancel()
    await until(lambda: decode.servicer.generation.in_flight == 0, timeout=10)
    # Once the first has ended the id is free again.
    async for _ in stub.Generate(dpb.GenerateRequest(request_id="twice", prompt_token_ids=[1], max_tokens=1), timeout=10):
        pass


async def test_a_request_cut_by_the_end_of_the_drain_grace_gets_our_unavailable(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, "--drain-seconds", "0.5", engine=stamp.SlowStamp)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    call = stub.Generate(dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=200), timeout=30)
    assert (await call.read()).WhichOneof("payload") == "chunk"
    await decode.stop()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while await call.read() is not grpc.aio.EOF:
            pass
    failure = describe(err.value)
    assert failure.status == "UNAVAILABLE" and failure.reason == "DRAIN_GRACE_ENDED", failure
    assert "drain grace ran out" in failure.message and "Cancelling" not in failure.message
    assert finished(decode, "UNAVAILABLE") == 1 and finished(decode, "CANCELLED") == 0


def handle_notifications_late(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Test-only: prefill handles each READ notification `seconds` late (its pin ends that late)."""
    from prefill_svc.pins import PinTable

    on_time = PinTable._on_wait_done

    def late(self: PinTable, pin: Any, wait: Any) -> None:
        asyncio.get_running_loop().call_later(seconds, on_time, self, pin, wait)

    monkeypatch.setattr(PinTable, "_on_wait_done", late)


@pytest.mark.parametrize("notifications_late", [False, True], ids=["notified-at-once", "notified-late"])
async def test_a_request_id_reused_the_moment_its_request_ended_is_served(
    start_prefill: Any, start_decode: Any, channel_to: Any, monkeypatch: pytest.MonkeyPatch, notifications_late: bool
) -> None:
    """Prefill frees a request decode read when the READ notifications reach it, a little after
    decode has them: a job reusing the id meanwhile waits for that pin to end instead of failing
    ALREADY_EXISTS. The late case (test-only: prefill handles each notification half a second
    late) refused the second request every time before."""
    if notifications_late:
        handle_notifications_late(monkeypatch, 0.5)
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    request = dpb.GenerateRequest(request_id="again", prompt_token_ids=[1, 2, 3, 4], max_tokens=3)
    for _ in range(3):
        replies = [r async for r in stub.Generate(request, timeout=30)]
        assert replies[-1].WhichOneof("payload") == "summary"
    await until(lambda: len(prefill.pins) == 0, timeout=10)


async def test_a_reused_id_whose_earlier_pin_does_not_end_is_already_exists(
    start_prefill: Any, start_decode: Any, channel_to: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for an earlier pin of the id is bounded (shortened here; test-only: prefill
    handles the notifications 5 s late), then the job fails as a running duplicate would."""
    from prefill_svc import session

    handle_notifications_late(monkeypatch, 5.0)
    monkeypatch.setattr(session, "REUSED_ID_WAIT_SECONDS", 0.2)
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    request = dpb.GenerateRequest(request_id="held", prompt_token_ids=[1, 2, 3, 4], max_tokens=3)
    async for _ in stub.Generate(request, timeout=30):
        pass
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(request, timeout=30):
            pass
    failure = describe(err.value)
    assert failure.status == "ALREADY_EXISTS" and "job.request_id" in failure.message, failure
