"""Decode computing prompts itself (--local-prefill), through the real services (reference engine,
real NIXL): with no prefill engine ready a plain request is prefilled on decode and decodes in the
step loop, its tokens equal to the colocated run; prompts below --local-prefill-below never go to
prefill; `off` keeps the old failures. Counted per reason, nothing left held."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_svc.app import DecodeApp
from shared.config import parse_settings
from shared.engine.reference.colocated import colocated_generate
from shared.layout.presets import TINY_PRESETS
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.status import describe
from shared.runtime.engine_host import engine_factory_for
from tests.decode_stream import generated
from tests.integration.exactness.pair import all_freed, service_pair
from tests.integration.services.checkpoint_checks import count_jobs

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

MODEL = "tiny-mamba2"
COMMON = ["--model", MODEL, "--engine", "reference", "--num-blocks", "96", "--port", "0", "--loop", "asyncio"]


def prompt_of(n: int, start: int = 40) -> list[int]:
    return [(start + 3 * i) % 250 + 1 for i in range(n)]


def local_prefills(app: DecodeApp, reason: str) -> float:
    text = app.metrics.telemetry.exposition()
    line = next(x for x in text.splitlines() if x.startswith(f'hybrid_pd_local_prefills_total{{reason="{reason}"}}'))
    return float(line.split()[-1])


async def test_a_decode_without_prefill_computes_plain_requests_and_off_refuses_them() -> None:
    settings = parse_settings("decode", [*COMMON, "--engine-id", "alone"], environ={})
    decode = await DecodeApp.start(settings, engine_factory_for("reference"))
    try:
        assert decode.shell.health.ready  # its own engine decides readiness
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            prompts = [prompt_of(5 + 7 * i, 30 + i) for i in range(4)]
            got = await asyncio.gather(
                *(generated(stub, pb.GenerateRequest(prompt_token_ids=p, max_tokens=9), timeout=60) for p in prompts)
            )
        for prompt, (tokens, summary) in zip(prompts, got):
            assert tokens == colocated_generate(TINY_PRESETS[MODEL], prompt, 9)
            assert summary.prefilled_locally and summary.prefill_engine_id == "alone" and summary.prefill_target == ""
            assert summary.transfer.total_bytes == 0 and summary.num_transferred_tokens == 0
        assert local_prefills(decode, "no_prefill_ready") == 4
        assert decode.servicer.generation.step_loop.largest_batch > 1  # they decoded in shared steps
        assert decode.host.allocator.num_used == 0
    finally:
        await decode.stop()
    off = parse_settings("decode", [*COMMON, "--engine-id", "off", "--local-prefill", "off"], environ={})
    decode = await DecodeApp.start(off, engine_factory_for("reference"))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generated(
                    pb_grpc.DecodeServiceStub(channel),
                    pb.GenerateRequest(prompt_token_ids=prompt_of(5), max_tokens=3),
                    timeout=60,
                )
        failure = describe(err.value)
        assert failure.status == "FAILED_PRECONDITION" and failure.reason == "NO_PREFILL_PEER", failure
        assert local_prefills(decode, "no_prefill_ready") == 0
    finally:
        await decode.stop()


async def test_requests_after_every_prefill_stopped_are_computed_on_decode() -> None:
    async with service_pair(MODEL, 1, 1) as pair:
        before, summary = await generated(pair.stub, pb.GenerateRequest(prompt_token_ids=prompt_of(30), max_tokens=6), timeout=60)
        assert not summary.prefilled_locally and summary.transfer.total_bytes > 0
        await pair.prefill.stop()
        peers = pair.decode.servicer.generation.peers
        while peers.any_ready:
            await asyncio.sleep(0.02)
        assert pair.decode.shell.health.ready  # a slowdown, not an outage
        after, summary = await generated(pair.stub, pb.GenerateRequest(prompt_token_ids=prompt_of(30), max_tokens=6), timeout=60)
        assert after == before == colocated_generate(TINY_PRESETS[MODEL], prompt_of(30), 6)
        assert summary.prefilled_locally and summary.transfer.total_bytes == 0
        assert local_prefills(pair.decode, "no_prefill_ready") == 1
        assert pair.decode.host.allocator.num_used == 0


async def test_prompts_below_the_threshold_never_go_to_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = count_jobs(monkeypatch)
    async with service_pair(MODEL, 1, 1, extra_decode=["--local-prefill-below", "16"]) as pair:
        short, long = prompt_of(15), prompt_of(16)
        (got_short, s_short), (got_long, s_long) = await asyncio.gather(
            generated(pair.stub, pb.GenerateRequest(prompt_token_ids=short, max_tokens=5), timeout=60),
            generated(pair.stub, pb.GenerateRequest(prompt_token_ids=long, max_tokens=5), timeout=60),
        )
        assert got_short == colocated_generate(TINY_PRESETS[MODEL], short, 5)
        assert got_long == colocated_generate(TINY_PRESETS[MODEL], long, 5)
        assert s_short.prefilled_locally and not s_long.prefilled_locally
        assert local_prefills(pair.decode, "short_prompt") == 1 and local_prefills(pair.decode, "no_prefill_ready") == 0
        assert len(jobs) == 1  # the long prompt's
        assert await all_freed(pair)
