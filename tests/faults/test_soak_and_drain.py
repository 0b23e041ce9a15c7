"""Soak: many requests, 32 at a time, some cancelled by the client at random moments: no block
leaks on either side, no growth of open READ handles or file descriptors, bounded resident
memory. Then SIGTERM decode under load: NOT_SERVING at once, new work refused with
UNAVAILABLE, every in-flight request finishes, exit 0.

The CI soak runs 200 requests; the full one (2,000) runs with HYBRID_PD_SLOW=1 (marker slow).
Figures are printed (run with -s).
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridpd_tools.bench.local_pair import DECODE_SERVICE
from tests.faults.harness import Outcome, Service, Spec, free_port, generate, start_many

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.asyncio]

CONCURRENCY = 32
CANCEL_FRACTION = 0.2
RSS_GROWTH_BOUND = 96 << 20
FD_GROWTH_BOUND = 8


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Service, Service]]:
    port = free_port()
    prefill, decode = start_many(
        Spec(
            "prefill",
            ("--engine-id", "soak-prefill", "--num-blocks", "512", "--heartbeat-seconds", "1", "--lease-seconds", "10",
             "--port", str(port)),
        ),
        Spec(
            "decode",
            ("--engine-id", "soak-decode", "--num-blocks", "512", "--check-state", "--drain-seconds", "15",
             "--prefill", f"127.0.0.1:{port}"),
            pauses="after_read:1:drain-",
        ),
    )  # fmt: skip
    try:
        yield prefill, decode
    finally:
        for service in (prefill, decode):
            service.kill()


async def soak(decode: Service, count: int, seed: int) -> Counter[str]:
    """`count` requests, CONCURRENCY at a time, CANCEL_FRACTION cancelled at a random moment."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(CONCURRENCY)
    statuses: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(decode.address) as channel:

        async def one(i: int) -> None:
            prompt = [rng.randrange(1, 256) for _ in range(rng.randrange(1, 48))]
            max_tokens = rng.randrange(1, 32)
            cancel_after = rng.uniform(0.0, 0.03) if rng.random() < CANCEL_FRACTION else None
            async with gate:
                call = asyncio.ensure_future(generate(decode.address, f"soak-{seed}-{i}", prompt, max_tokens, channel=channel))
                if cancel_after is not None:
                    await asyncio.sleep(cancel_after)
                    call.cancel()
                try:
                    outcome: Outcome = await call
                    statuses[outcome.status] += 1
                    if outcome.status != "OK":
                        print(f"\nunexpected: {outcome}", file=sys.stderr)
                except asyncio.CancelledError:
                    statuses["cancelled by the client"] += 1

        await asyncio.gather(*(one(i) for i in range(count)))
    return statuses


async def settled(prefill: Service, decode: Service) -> tuple[dict[str, float], dict[str, float]]:
    """Metrics once every request has ended on both sides (prefill frees on notifications)."""
    for service in (prefill, decode):
        await service.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0, timeout=20)
        await service.wait_metric("hybrid_pd_open_read_handles", lambda v: v == 0)
        await service.wait_metric("hybrid_pd_reads_in_flight", lambda v: v == 0)
    await prefill.wait_metric("hybrid_pd_pinned_requests", lambda v: v == 0)
    await decode.wait_metric("hybrid_pd_requests_in_flight", lambda v: v == 0)
    return await prefill.metrics(), await decode.metrics()


async def run_soak(pair: tuple[Service, Service], count: int) -> None:
    prefill, decode = pair
    await decode.wait_serving()
    await soak(decode, 64, seed=1)  # warm-up: allocator runs, channels, caches, lazy imports
    base = await settled(prefill, decode)
    started = time.monotonic()
    statuses = await soak(decode, count, seed=2)
    seconds = time.monotonic() - started
    end = await settled(prefill, decode)
    assert set(statuses) <= {"OK", "cancelled by the client"}, statuses
    assert statuses["OK"] > count // 2
    print(f"\n[soak] {count} requests, {CONCURRENCY} concurrent, {seconds:.1f} s: {dict(statuses)}", file=sys.stderr)
    for role, before, after in (("prefill", base[0], end[0]), ("decode", base[1], end[1])):
        rss = after["process_resident_memory_bytes"] - before["process_resident_memory_bytes"]
        fds = after["process_open_fds"] - before["process_open_fds"]
        print(
            f"[soak] {role}: blocks in use {after['hybrid_pd_blocks_in_use']:.0f}, open READ handles "
            f"{after['hybrid_pd_open_read_handles']:.0f}, fds {before['process_open_fds']:.0f} -> "
            f"{after['process_open_fds']:.0f}, RSS {before['process_resident_memory_bytes'] / 2**20:.1f} -> "
            f"{after['process_resident_memory_bytes'] / 2**20:.1f} MiB",
            file=sys.stderr,
        )
        assert after["hybrid_pd_blocks_in_use"] == 0
        assert after["hybrid_pd_open_read_handles"] == 0
        assert fds <= FD_GROWTH_BOUND, (role, fds)
        assert rss <= RSS_GROWTH_BOUND, (role, rss)
    pins = {k: v for k, v in end[0].items() if k.startswith("hybrid_pd_pins_ended_total")}
    print(f"[soak] prefill pins ended: {pins}", file=sys.stderr)
    assert end[0]["hybrid_pd_lease_expiries_total"] == 0  # every pin ended by a READ, release or cancel


@pytest.mark.timeout(120)
async def test_soak_ci(pair: tuple[Service, Service]) -> None:
    await run_soak(pair, 200)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_soak_full(pair: tuple[Service, Service]) -> None:
    await run_soak(pair, 2000)


@pytest.mark.timeout(90)
async def test_sigterm_drains_under_load(pair: tuple[Service, Service]) -> None:
    prefill, decode = pair
    await decode.wait_serving()
    async with grpc.aio.insecure_channel(decode.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=DECODE_SERVICE))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        calls = [asyncio.ensure_future(generate(decode.address, f"drain-{i}", max_tokens=16)) for i in range(CONCURRENCY)]
        await decode.wait_metric("hybrid_pd_requests_in_flight", lambda v: v == CONCURRENCY)
        decode.signal(signal.SIGTERM)
        signalled = time.monotonic()
        update = await asyncio.wait_for(watch.read(), 5)
        not_serving_after = time.monotonic() - signalled
        assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
        late = await generate(decode.address, "too-late-1")
        assert late.status == "UNAVAILABLE", late
        outcomes = await asyncio.gather(*calls)
    assert all(o.status == "OK" and len(o.tokens) == 16 for o in outcomes), [o for o in outcomes if o.status != "OK"]
    code = await asyncio.to_thread(decode.returncode, 30)
    exited_after = time.monotonic() - signalled
    print(
        f"\n[drain] NOT_SERVING {not_serving_after * 1000:.0f} ms after SIGTERM; {CONCURRENCY} in-flight requests "
        f"finished; exit {code} after {exited_after:.2f} s",
        file=sys.stderr,
    )
    assert code == 0
    await prefill.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    prefill.signal(signal.SIGTERM)
    assert await asyncio.to_thread(prefill.returncode, 30) == 0
