"""Handshake rejections name every differing field; a session needs a handshake first."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.pb.hybridpd.v1 import layout_pb2 as lpb
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.status import RpcFailure, describe

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def handshake(channel: grpc.aio.Channel, layout: lpb.EngineLayout) -> RpcFailure | pb.HandshakeResponse:
    try:
        response: pb.HandshakeResponse = await pb_grpc.PrefillServiceStub(channel).Handshake(
            pb.HandshakeRequest(layout=layout), timeout=10
        )
        return response
    except grpc.aio.AioRpcError as e:
        return describe(e)


async def test_compatible_handshake_returns_prefill_layout(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    answer = await handshake(channel_to(prefill.port), decode.host.message)
    assert isinstance(answer, pb.HandshakeResponse)
    assert answer.layout.engine_id == "test-prefill"
    assert answer.layout.role == lpb.ENGINE_ROLE_PREFILL
    assert len(answer.layout.ranks) == 1 and answer.layout.ranks[0].agent_metadata


async def test_incompatible_fields_are_all_named(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    layout = lpb.EngineLayout()
    layout.CopyFrom(decode.host.message)
    layout.model.kv_dtype = lpb.DATA_TYPE_FP8
    layout.model.ssm_dtype = lpb.DATA_TYPE_BF16
    layout.conv_layout = lpb.CONV_LAYOUT_SD
    layout.model.name = "another-model"
    answer = await handshake(channel_to(prefill.port), layout)
    assert isinstance(answer, RpcFailure)
    assert answer.status == "FAILED_PRECONDITION"
    assert answer.reason == "INCOMPATIBLE_LAYOUT"
    assert {"model.kv_dtype", "model.ssm_dtype", "conv_layout", "model.name"} <= set(answer.fields)
    for text in ("model.kv_dtype", "prefill fp32, decode fp8", "model.ssm_dtype", "conv_layout", "model.name"):
        assert text in answer.message


async def test_malformed_layout_is_invalid_argument(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    layout = lpb.EngineLayout()
    layout.CopyFrom(decode.host.message)
    layout.ranks[0].agent_metadata = b""
    del layout.ranks[0].region_base_addresses[:]
    answer = await handshake(channel_to(prefill.port), layout)
    assert isinstance(answer, RpcFailure)
    assert answer.status == "INVALID_ARGUMENT"
    assert set(answer.fields) == {"layout.ranks[0].agent_metadata", "layout.ranks[0].region_base_addresses"}
    missing = await handshake(channel_to(prefill.port), lpb.EngineLayout())
    assert isinstance(missing, RpcFailure) and missing.status == "INVALID_ARGUMENT"


async def test_a_decode_layout_announcing_prefill_chunks_is_refused(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    layout = lpb.EngineLayout()
    layout.CopyFrom(decode.host.message)
    control = await handshake(channel_to(prefill.port), layout)
    assert layout.prefill_chunk_tokens == 0 and isinstance(control, pb.HandshakeResponse)
    layout.prefill_chunk_tokens = 32  # only a prefill engine chunks its prefill
    answer = await handshake(channel_to(prefill.port), layout)
    assert isinstance(answer, RpcFailure)
    assert answer.status == "INVALID_ARGUMENT" and answer.fields == ("layout.prefill_chunk_tokens",), answer.message


@pytest.mark.parametrize(
    ("flags", "fields"),
    [
        (("--kv-dtype", "bf16"), {"model.kv_dtype", "model.fingerprint"}),
        (("--model", "tiny-gdn"), {"model.name", "model.fingerprint", "model.family"}),
    ],
)
async def test_decode_with_incompatible_model_stays_not_ready(
    start_prefill: Any, start_decode: Any, channel_to: Any, flags: tuple[str, ...], fields: set[str]
) -> None:
    prefill = await start_prefill()
    # No fallback: decode would compute the request itself (test_services_local_prefill.py).
    decode = await start_decode(prefill.port, *flags, "--local-prefill", "off", ready=False)
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    # The peer loop records the refusal; GetLayout shows it.
    for _ in range(200):
        status = (await stub.GetLayout(dpb.GetLayoutRequest(), timeout=5)).peers[0]
        if status.state == dpb.PEER_STATE_FAILED:
            break
        await asyncio.sleep(0.02)
    assert status.state == dpb.PEER_STATE_FAILED
    assert "FAILED_PRECONDITION" in status.last_error
    for field in fields:
        assert field in status.last_error
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(dpb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2), timeout=5):
            pass
    failure = describe(err.value)
    assert failure.status == "UNAVAILABLE"
    assert "no prefill engine is ready" in failure.message and "model.fingerprint" in failure.message


async def test_session_without_handshake_is_refused(start_prefill: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    call = pb_grpc.PrefillServiceStub(channel_to(prefill.port)).Session(timeout=10)
    await call.write(pb.SessionRequest(hello=pb.SessionHello(decode_engine_id="stranger", decode_incarnation=7)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    failure = describe(err.value)
    assert failure.status == "FAILED_PRECONDITION"
    assert failure.reason == "HANDSHAKE_REQUIRED"
    assert failure.fields == ("hello.decode_engine_id",)


async def test_session_must_start_with_hello(start_prefill: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    call = pb_grpc.PrefillServiceStub(channel_to(prefill.port)).Session(timeout=10)
    await call.write(pb.SessionRequest(job=pb.PrefillJob(request_id="x", prompt_token_ids=[1])))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert describe(err.value).status == "FAILED_PRECONDITION"
    assert prefill.host.allocator.num_used == 0


async def test_an_incompatible_prefill_is_logged_once_at_error_and_retried_at_the_cap(
    start_prefill: Any, start_decode: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="decode_svc.prefill_peer")
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, "--model", "tiny-gdn", "--reconnect-max-seconds", "0.05", ready=False)
    peer = decode.peers.peers[0]
    assert peer.reconnect_max_seconds == 0.05
    async with asyncio.timeout(20):
        while peer.attempts < 5:
            await asyncio.sleep(0.02)
    mine = [r for r in caplog.records if r.name == "decode_svc.prefill_peer"]
    errors = [r for r in mine if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in mine]  # 5 refusals, one line
    assert "refuses this decode engine: FAILED_PRECONDITION" in errors[0].getMessage()
    assert "model.fingerprint" in errors[0].getMessage()
    assert not [r for r in mine if r.levelno == logging.WARNING]
