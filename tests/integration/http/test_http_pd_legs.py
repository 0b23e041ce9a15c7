"""vLLM's two P/D legs served for real, driven over HTTP exactly as vllm-router sends them: the
prefill leg computes and pins the state for a decode engine it does not know yet; the decode leg
(a decode engine started without --prefill) handshakes with the prefill engine the params name,
claims the pinned request, READs it and generates the colocated run's tokens. Bad or stale
params fail with an OpenAI error naming the field, and every block is freed on both sides (at
once by decode where it reached the prefill, by the lease where it could not). The
same two legs through gRPC: GenerateRequest.kv_transfer_params."""

from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import pytest_asyncio

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.engine.reference.colocated import colocated_generate
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.runtime.engine_host import engine_factory_for
from tests.integration.http.conftest import COMMON, MODEL, request
from tests.reuse import REUSE_OFF

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

LEASE_SECONDS = 2.0  # short, so the tests can watch an unclaimed pin end with its lease
# Long: a pin freed while a `held` test runs was given up by decode; its lease cannot have ended.
HELD_LEASE_SECONDS = 600.0
PREFILL_LEG_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


@dataclass
class Legs:
    prefill: PrefillApp
    decode: DecodeApp  # started without --prefill

    def url(self, app: PrefillApp | DecodeApp, path: str) -> str:
        return f"http://127.0.0.1:{app.shell.http_port}{path}"

    def expected(self, prompt: str | list[int], n: int) -> str:
        ids = list(prompt.encode()) if isinstance(prompt, str) else prompt
        return bytes(colocated_generate(self.decode.host.spec, ids, n)).decode("utf-8", errors="replace")

    async def post(self, app: PrefillApp | DecodeApp, path: str, body: Any, rid: str | None = None) -> Any:
        headers = {"X-Request-Id": rid} if rid else {}
        return await asyncio.to_thread(request, self.url(app, path), body, None, headers)

    async def prefill_leg(self, body: dict[str, Any], rid: str, path: str = "/v1/completions") -> dict[str, Any]:
        """What the router sends prefill, and the kv_transfer_params it gets back."""
        leg = body | {"max_tokens": 1, "min_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_LEG_PARAMS}
        reply = await self.post(self.prefill, path, leg, rid)
        assert reply.status == 200, reply.body
        kv: dict[str, Any] = reply.json()["kv_transfer_params"]
        return json.loads(json.dumps(kv))  # as it comes back through a router

    async def blocks_freed(self) -> None:
        async with asyncio.timeout(10):
            while self.prefill.host.allocator.num_used or self.decode.host.allocator.num_used or len(self.prefill.pins):
                await asyncio.sleep(0.02)

    def ended(self) -> Counter[str]:
        """Prefill's pins ended so far, by reason (subtract an earlier copy for one test's)."""
        return Counter(self.prefill.pins.ended)


async def _start_legs(name: str, lease_seconds: float) -> Legs:
    factory = engine_factory_for("reference")
    lease = ["--lease-seconds", str(lease_seconds)]
    prefill = await PrefillApp.start(
        parse_settings("prefill", [*COMMON, *lease, "--engine-id", f"{name}-prefill"], environ={}), factory
    )
    decode_flags = [*COMMON, "--engine-id", f"{name}-decode", *REUSE_OFF]
    decode = await DecodeApp.start(parse_settings("decode", decode_flags, environ={}), factory)
    return Legs(prefill, decode)


async def _stop_legs(legs: Legs) -> None:
    await asyncio.wait_for(legs.decode.stop(), 30)
    await asyncio.wait_for(legs.prefill.stop(), 30)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def legs() -> AsyncIterator[Legs]:
    pair = await _start_legs("leg", LEASE_SECONDS)
    try:
        yield pair
    finally:
        await _stop_legs(pair)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def held() -> AsyncIterator[Legs]:
    """A pair whose prefill leases outlast the tests: only decode can free an unclaimed pin."""
    pair = await _start_legs("held", HELD_LEASE_SECONDS)
    try:
        yield pair
    finally:
        await _stop_legs(pair)


async def test_the_unclaimed_lease_is_renewed_on_the_loop_when_the_answer_left(legs: Legs) -> None:
    """The lease counts from when the prefill leg's answer was sent: renewed after the answer,
    on the event loop (the pins' thread), finding the pin. Before, the renewal ran on a worker
    thread and failed there, so the lease counted from the pin."""
    renewed: list[tuple[list[str], bool, int | BaseException]] = []
    pins = legs.prefill.pins
    renew = pins.renew

    def recording(owner: str, request_ids: list[str]) -> int:
        on_loop = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            on_loop = False
        try:
            found = renew(owner, request_ids)
        except BaseException as e:
            renewed.append((request_ids, on_loop, e))
            raise
        renewed.append((request_ids, on_loop, found))
        return found

    pins.renew = recording  # type: ignore[method-assign]
    try:
        kv = await legs.prefill_leg({"model": MODEL, "prompt": "renew me", "max_tokens": 3}, "leg-renew")
        async with asyncio.timeout(10):
            while not any(ids == ["leg-renew"] for ids, _, _ in renewed):
                await asyncio.sleep(0.01)
    finally:
        pins.renew = renew  # type: ignore[method-assign]
    assert [(on_loop, found) for ids, on_loop, found in renewed if ids == ["leg-renew"]] == [(True, 1)], renewed
    assert legs.prefill.servicer.handoffs.give_up("leg-renew", kv["hybrid_pd"]["transfer_id"])
    await legs.blocks_freed()


async def test_prefill_leg_answers_kv_transfer_params_and_pins_for_an_unknown_reader(legs: Legs) -> None:
    kv = await legs.prefill_leg({"model": MODEL, "prompt": "hello world", "max_tokens": 5}, "leg-a")
    p = legs.prefill
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == "leg-prefill" and kv["remote_request_id"] == "leg-a"
    assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", p.port) and kv["tp_size"] == 1
    groups = kv["remote_block_ids"]
    assert len(groups) == len(p.host.layout.groups) and all(type(b) is int for ids in groups for b in ids)
    assert kv["remote_num_tokens"] == len(b"hello world")
    assert kv["hybrid_pd"]["num_computed_tokens"] == p.host.engine.num_prefill_tokens(len(b"hello world"))
    assert p.host.allocator.num_used == sum(len(ids) for ids in groups) > 0
    assert len(p.servicer.handoffs) == 1
    # Nobody claims it: the lease ends it and its blocks are freed.
    await legs.blocks_freed()
    assert len(p.servicer.handoffs) == 0 and p.pins.ended["lease_expired"] >= 1


async def test_two_legs_give_the_colocated_tokens_completions_and_chat_streamed_and_not(legs: Legs) -> None:
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": "two legs", "max_tokens": 7}),
        ("/v1/completions", {"model": MODEL, "prompt": "two legs, streamed", "max_tokens": 7, "stream": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}),
    ]
    for n, (path, body) in enumerate(cases):
        kv = await legs.prefill_leg(body, f"legs-{n}", path)
        reply = await legs.post(legs.decode, path, body | {"kv_transfer_params": kv}, f"legs-{n}")
        assert reply.status == 200, reply.body
        prompt = str(body.get("prompt", "<|user|>\nhi\n<|assistant|>\n"))
        if body.get("stream"):
            events = [line[6:] for line in reply.body.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        elif "messages" in body:
            text = reply.json()["choices"][0]["message"]["content"]
        else:
            text = reply.json()["choices"][0]["text"]
            assert reply.json()["usage"]["completion_tokens"] == 7
        assert text == legs.expected(prompt, 7)
        # Negative control: the colocated run of another prompt differs, so the comparison can fail.
        assert text != legs.expected(prompt + "!", 7)
    # Read by notification (not by lease): the pins ended "read", and the learned peer is cached.
    assert legs.prefill.pins.ended["read"] >= len(cases)
    assert list(legs.decode.learned.peers) == [f"127.0.0.1:{legs.prefill.port}"]
    await legs.blocks_freed()


async def test_concurrent_decode_legs_share_one_handshake(legs: Legs) -> None:
    handshakes = legs.prefill.metrics.registry.get_sample_value("hybrid_pd_handshakes_total", {"result": "ok"}) or 0

    async def one(i: int) -> str:
        body = {"model": MODEL, "prompt": f"concurrent {i}", "max_tokens": 5}
        kv = await legs.prefill_leg(body, f"conc-{i}")
        reply = await legs.post(legs.decode, "/v1/completions", body | {"kv_transfer_params": kv}, f"conc-{i}")
        assert reply.status == 200, reply.body
        return str(reply.json()["choices"][0]["text"])

    texts = await asyncio.gather(*(one(i) for i in range(8)))
    assert texts == [legs.expected(f"concurrent {i}", 5) for i in range(8)]
    after = legs.prefill.metrics.registry.get_sample_value("hybrid_pd_handshakes_total", {"result": "ok"}) or 0
    assert after - handshakes <= 1  # at most one (none when the peer was cached by an earlier test)
    await legs.blocks_freed()


def _bad(kv: dict[str, Any], path: list[str | int], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(kv)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "status", "param"),
    [
        (["remote_engine_id"], "someone-else", 409, "kv_transfer_params.remote_engine_id"),
        (["remote_block_ids"], [[1], [2], [3], [4], [5]], 400, "kv_transfer_params.remote_block_ids"),
        (["remote_block_ids", 0, 0], 10_000, 400, "kv_transfer_params.remote_block_ids[0][0]"),
        (["tp_size"], 2, 400, "kv_transfer_params.tp_size"),
        (["hybrid_pd", "incarnation"], "00000000deadbeef", 410, "kv_transfer_params.hybrid_pd.incarnation"),
    ],
)
async def test_params_not_matching_the_engine_fail_naming_the_field_and_decode_frees_the_pin_at_once(
    held: Legs, path: list[str | int], value: Any, status: int, param: str
) -> None:
    # Decode reached the prefill the params name and refused them before its claim: it gives
    # the pin up there (with the ids its params carry), so it ends "released", not by its lease.
    body = {"model": MODEL, "prompt": "bad params", "max_tokens": 3}
    kv = await held.prefill_leg(body, "bad")
    before = held.ended()
    reply = await held.post(held.decode, "/v1/completions", body | {"kv_transfer_params": _bad(kv, path, value)}, "bad")
    assert reply.status == status, reply.body
    assert reply.json()["error"]["param"] == param, reply.body
    await held.blocks_freed()
    assert held.ended() - before == Counter(released=1)


@pytest.mark.parametrize(
    ("path", "value", "status", "param"),
    [
        (["pp_size"], 1.0, 400, "kv_transfer_params.pp_size"),
        (["remote_port"], KeyError, 400, "kv_transfer_params.remote_port"),
        (["hybrid_pd", "transfer_id"], KeyError, 400, "kv_transfer_params.hybrid_pd.transfer_id"),
        (["hybrid_pd", "transfer_id"], "t-unknown", 410, "kv_transfer_params.remote_request_id"),
        (["remote_request_id"], "never-prefilled", 410, "kv_transfer_params.remote_request_id"),
    ],
)
async def test_unusable_or_stale_params_fail_naming_the_field_and_the_lease_frees_the_pin(
    legs: Legs, path: list[str | int], value: Any, status: int, param: str
) -> None:
    # Params that do not parse, or name no pin of that engine, cannot give the real pin up: its
    # lease ends it (decode sends nothing, or nothing that matches).
    body = {"model": MODEL, "prompt": "bad params", "max_tokens": 3}
    kv = await legs.prefill_leg(body, "bad")
    before = legs.ended()
    reply = await legs.post(legs.decode, "/v1/completions", body | {"kv_transfer_params": _bad(kv, path, value)}, "bad")
    assert reply.status == status, reply.body
    assert reply.json()["error"]["param"] == param, reply.body
    assert legs.decode.host.allocator.num_used == 0
    await legs.blocks_freed()
    assert legs.ended() - before == Counter(lease_expired=1)


async def test_a_forged_transfer_id_cannot_give_up_the_pin(held: Legs) -> None:
    body = {"model": MODEL, "prompt": "forged", "max_tokens": 3}
    kv = await held.prefill_leg(body, "forged")
    before = held.ended()
    forged = _bad(_bad(kv, ["tp_size"], 2), ["hybrid_pd", "transfer_id"], "t-forged")
    reply = await held.post(held.decode, "/v1/completions", body | {"kv_transfer_params": forged})
    assert reply.status == 400 and reply.json()["error"]["param"] == "kv_transfer_params.tp_size", reply.body
    # A whole decode leg after it on the same session stream, so prefill has handled the give-up.
    ok = {"model": MODEL, "prompt": "after the forgery", "max_tokens": 3}
    ok_kv = await held.prefill_leg(ok, "after-forged")
    reply = await held.post(held.decode, "/v1/completions", ok | {"kv_transfer_params": ok_kv})
    assert reply.status == 200 and reply.json()["choices"][0]["text"] == held.expected("after the forgery", 3)
    assert held.prefill.pins.lookup("", "forged") is not None  # still pinned, for whoever has its real ids
    assert held.ended() - before == Counter(read=1)
    # The same failure with the real transfer id gives it up (the control of the control).
    reply = await held.post(held.decode, "/v1/completions", body | {"kv_transfer_params": _bad(kv, ["tp_size"], 2)})
    assert reply.status == 400, reply.body
    await held.blocks_freed()
    assert held.ended() - before == Counter(read=1, released=1)


async def test_decode_cache_full_until_the_deadline_or_cancelled_frees_the_pin_at_once(held: Legs) -> None:
    decode = held.decode.host
    decode.allocator.allocate("filler", decode.allocator.num_free)  # the decode cache is full
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{held.decode.port}") as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            kv = await held.prefill_leg({"model": MODEL, "prompt": "no room", "max_tokens": 3}, "no-room")
            before = held.ended()
            full = pb.GenerateRequest(request_id="no-room", prompt="no room", max_tokens=3, kv_transfer_params=json.dumps(kv))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(full, timeout=1.0).read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            async with asyncio.timeout(10):
                while held.prefill.pins.lookup("", "no-room") is not None:
                    await asyncio.sleep(0.02)
            assert held.ended() - before == Counter(released=1)

            # The client goes away while the decode leg waits for blocks.
            kv = await held.prefill_leg({"model": MODEL, "prompt": "gone", "max_tokens": 3}, "gone")
            before = held.ended()
            gone = pb.GenerateRequest(request_id="gone", prompt="gone", max_tokens=3, kv_transfer_params=json.dumps(kv))
            call = stub.Generate(gone, timeout=60)
            async with asyncio.timeout(10):
                while decode.waiting_for_blocks == 0:
                    await asyncio.sleep(0.02)
            call.cancel()
            async with asyncio.timeout(10):
                while held.prefill.pins.lookup("", "gone") is not None:
                    await asyncio.sleep(0.02)
            assert held.ended() - before == Counter(released=1)
    finally:
        decode.free("filler")
    await held.blocks_freed()


async def test_expired_lease_is_410_and_a_second_claim_too(legs: Legs) -> None:
    body = {"model": MODEL, "prompt": "late", "max_tokens": 3}
    kv = await legs.prefill_leg(body, "late")
    await legs.blocks_freed()  # lease ran out before the decode leg came
    late = await legs.post(legs.decode, "/v1/completions", body | {"kv_transfer_params": kv}, "late")
    assert late.status == 410 and late.json()["error"]["param"] == "kv_transfer_params.remote_request_id", late.body
    kv = await legs.prefill_leg(body, "twice")
    first = await legs.post(legs.decode, "/v1/completions", body | {"kv_transfer_params": kv}, "twice")
    assert first.status == 200 and first.json()["choices"][0]["text"] == legs.expected("late", 3)
    again = await legs.post(legs.decode, "/v1/completions", body | {"kv_transfer_params": kv}, "twice")
    assert again.status == 410, again.body
    await legs.blocks_freed()


async def test_decode_leg_with_another_prompt_is_refused_and_releases_the_claimed_pin(legs: Legs) -> None:
    kv = await legs.prefill_leg({"model": MODEL, "prompt": "the prompt", "max_tokens": 3}, "other")
    released = legs.prefill.pins.ended["released"]
    reply = await legs.post(
        legs.decode, "/v1/completions", {"model": MODEL, "prompt": "another prompt", "max_tokens": 3, "kv_transfer_params": kv}
    )
    assert reply.status == 400 and reply.json()["error"]["param"] == "prompt", reply.body
    await legs.blocks_freed()
    assert legs.prefill.pins.ended["released"] == released + 1  # freed by decode's release, not the lease


async def test_prefill_engine_alone_refuses_plain_requests_and_decode_without_prefill_computes_them(legs: Legs) -> None:
    body = {"model": MODEL, "prompt": "plain", "max_tokens": 3}
    plain = await legs.post(legs.decode, "/v1/completions", body)  # --local-prefill fallback: computed on decode
    assert plain.status == 200 and plain.json()["choices"][0]["text"] == legs.expected("plain", 3), plain.body
    on_prefill = await legs.post(legs.prefill, "/v1/completions", body)
    assert on_prefill.status == 400 and on_prefill.json()["error"]["param"] == "kv_transfer_params"
    health = await asyncio.to_thread(request, legs.url(legs.decode, "/health"))
    assert health.status == 200  # ready without any prefill peer: the router's health check passes
    await legs.blocks_freed()


async def test_unreachable_prefill_named_by_params_is_503_naming_the_host(legs: Legs) -> None:
    body = {"model": MODEL, "prompt": "nobody home", "max_tokens": 3}
    kv = await legs.prefill_leg(body, "unreachable")
    reply = await legs.post(legs.decode, "/v1/completions", body | {"kv_transfer_params": kv | {"remote_port": 1}})
    assert reply.status == 503 and reply.json()["error"]["param"] == "kv_transfer_params.remote_host", reply.body
    assert "127.0.0.1:1" not in legs.decode.learned.peers  # forgotten once it failed
    await legs.blocks_freed()


async def test_grpc_generate_runs_the_decode_leg_from_kv_transfer_params(legs: Legs) -> None:
    body = {"model": MODEL, "prompt": "over grpc", "max_tokens": 6}
    kv = await legs.prefill_leg(body, "grpc-leg")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{legs.decode.port}") as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        request_ = pb.GenerateRequest(request_id="grpc-leg", prompt="over grpc", max_tokens=6, kv_transfer_params=json.dumps(kv))
        responses = [r async for r in stub.Generate(request_, timeout=30)]
        ids = [t for r in responses if r.WhichOneof("payload") == "chunk" for t in r.chunk.token_ids]
        summary = responses[-1].summary
        assert ids == colocated_generate(legs.decode.host.spec, list(b"over grpc"), 6)
        assert summary.prefill_engine_id == "leg-prefill" and summary.transfer.read_count == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=1, kv_transfer_params="{not json"), timeout=30).read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_transfer_params" in (info.value.details() or "")
    await legs.blocks_freed()
