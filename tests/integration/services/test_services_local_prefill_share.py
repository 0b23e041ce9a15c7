"""--local-prefill share through the real services (paged engine, a real tiny checkpoint, NIXL
over UCX on DRAM): while the prefill engine is busy, decode computes some of a burst's prompts
itself, and which side computed a prompt (a matter of load) never changes its bits: every reply
of the burst equals the same request's sent alone through prefill. A prefill engine that
computes in other chunks (other bits) is never relieved. Nothing is left held."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
import pytest

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from tests.integration.services.hf_services import hf_pair
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]

SHARE = ("--local-prefill", "share", "--local-prefill-queue-tokens", "1")


def prompt_of(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 300 + 4 for i in range(n)]


BURST = [
    pb.GenerateRequest(prompt_token_ids=prompt_of(5 + 9 * i, i), max_tokens=5, ignore_eos=True, logprobs=2) for i in range(6)
]
# Prompts of one length: the rule (by tokens) splits a burst of them half and half, whatever the
# order the server takes them in.
EVEN_BURST = [
    pb.GenerateRequest(prompt_token_ids=prompt_of(20, 3 * i), max_tokens=5, ignore_eos=True, logprobs=2) for i in range(6)
]


def local_prefills(app: DecodeApp, reason: str) -> float:
    text = app.metrics.telemetry.exposition()
    line = next(x for x in text.splitlines() if x.startswith(f'hybrid_pd_local_prefills_total{{reason="{reason}"}}'))
    return float(line.split()[-1])


async def replies(stub: pb_grpc.DecodeServiceAsyncStub, request: pb.GenerateRequest) -> tuple[list[bytes], bool]:
    """Every token chunk (ids and logprobs, as bytes) and whether decode computed the prompt."""
    chunks: list[bytes] = []
    here = False
    async for reply in stub.Generate(request, timeout=120):
        if reply.HasField("chunk"):
            chunks.append(reply.chunk.SerializeToString())
        elif reply.HasField("summary"):
            here = reply.summary.prefilled_locally
    return chunks, here


async def burst_while_prefill_is_held(prefill: PrefillApp, decode: DecodeApp) -> list[tuple[list[bytes], bool]]:
    """The first request's job holds prefill (its compute thread is held); the second is sent
    once that job is in flight and placed before the others come, so where each of the first
    two goes does not depend on the order the server takes concurrent calls in."""
    peer = decode.servicer.generation.peers.peers[0]
    placed = lambda: peer.load.jobs + local_prefills(decode, "prefill_busy")  # noqa: E731
    gate = threading.Event()
    held = prefill.host.submit_compute(lambda: gate.wait(60))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        try:
            calls = [asyncio.ensure_future(replies(stub, BURST[0]))]
            await until(lambda: peer.load.jobs == 1, "the first job to be in flight on prefill", timeout=60)
            calls.append(asyncio.ensure_future(replies(stub, BURST[1])))
            await until(lambda: placed() == 2, "the second request to be placed", timeout=60)
            calls += [asyncio.ensure_future(replies(stub, r)) for r in BURST[2:]]
            await until(lambda: placed() >= 3, "the burst", timeout=60)
        finally:
            gate.set()
        await held
        return list(await asyncio.gather(*calls))


async def alone(decode: DecodeApp, requests: list[pb.GenerateRequest] = BURST) -> list[tuple[list[bytes], bool]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        return [await replies(stub, r) for r in requests]


async def test_a_burst_splits_between_prefill_and_decode_with_the_bits_of_prefill_alone(
    hf_checkpoint: Callable[[str], str],
) -> None:
    model = hf_checkpoint("nemotron_h")
    async with hf_pair(model, model, 1, 1, engine="paged", decode_flags=SHARE) as (prefill, decode):
        burst = await burst_while_prefill_is_held(prefill, decode)
        one_by_one = await alone(decode)  # each finds prefill idle: every prompt goes there
        here = [h for _, h in burst]
        assert not here[0] and here[1], here  # the first job is prefill's; the next finds it busy
        assert not any(h for _, h in one_by_one)
        assert local_prefills(decode, "prefill_busy") == sum(here)
        for i, ((got, _), (want, _)) in enumerate(zip(burst, one_by_one, strict=True)):
            assert got == want, f"request {i} (computed {'on decode' if here[i] else 'on prefill'}) differs from alone"
        await until(lambda: decode.host.allocator.num_used == 0, "decode to free every block", timeout=30)
        await until(lambda: prefill.host.allocator.num_used == 0, "prefill to free every block", timeout=30)
        assert decode.servicer.generation.local.tokens_here == 0


async def test_a_burst_placed_before_any_of_its_jobs_is_sent_splits_too(hf_checkpoint: Callable[[str], str]) -> None:
    """Every request of the burst is placed while decode's cache is full, so each waits for
    blocks before its job goes to prefill: the requests placed on prefill count in its queue from
    the moment they are placed, so half the burst is computed on decode (prompts of one length, a
    queue of 1 token: prefill, decode, prefill, ...). Counted only once on prefill's session,
    every request saw prefill idle and none was shared (a burst arriving in one go was never
    relieved). The bits are still those of each request alone through prefill."""
    model = hf_checkpoint("nemotron_h")
    async with hf_pair(model, model, 1, 1, engine="paged", decode_flags=SHARE) as (prefill, decode):
        host, filler = decode.host, "test-fills-the-cache"
        host.take(filler, host.allocator.num_free)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            calls = [asyncio.ensure_future(replies(stub, r)) for r in EVEN_BURST]
            try:
                await until(lambda: host.waiting_for_blocks == len(EVEN_BURST), "the whole burst to wait for blocks", timeout=60)
            finally:
                host.free(filler)
            burst = list(await asyncio.gather(*calls))
        here = [h for _, h in burst]
        assert sum(here) == len(EVEN_BURST) // 2, here
        assert local_prefills(decode, "prefill_busy") == sum(here)
        one_by_one = await alone(decode, EVEN_BURST)
        assert not any(h for _, h in one_by_one)
        for i, ((got, _), (want, _)) in enumerate(zip(burst, one_by_one, strict=True)):
            assert got == want, f"request {i} (computed {'on decode' if here[i] else 'on prefill'}) differs from alone"
        await until(lambda: decode.host.allocator.num_used == 0, "decode to free every block", timeout=30)
        await until(lambda: prefill.host.allocator.num_used == 0, "prefill to free every block", timeout=30)
        peer = decode.servicer.generation.peers.peers[0]
        assert peer.load.jobs == 0 and peer.queued_tokens == 0 and decode.servicer.generation.local.tokens_here == 0


async def test_a_prefill_that_computes_in_other_chunks_is_never_relieved(hf_checkpoint: Callable[[str], str]) -> None:
    """Its bits differ from decode's one forward (shown here on the first request), so a prompt
    computed on decode would answer other bits depending on load: none is."""
    model = hf_checkpoint("nemotron_h")
    chunked = ("--prefill-chunk-tokens", "4")
    async with hf_pair(model, model, 1, 1, engine="paged", decode_flags=SHARE, prefill_flags=chunked, check_state=False) as (
        prefill,
        decode,
    ):
        burst = await burst_while_prefill_is_held(prefill, decode)
        assert not any(h for _, h in burst)
        assert local_prefills(decode, "prefill_busy") == 0
    async with hf_pair(model, model, 1, 1, engine="paged", decode_flags=SHARE) as (_, unchunked):
        one_forward = await alone(unchunked)
    assert any(got != want for (got, _), (want, _) in zip(burst, one_forward, strict=True))
