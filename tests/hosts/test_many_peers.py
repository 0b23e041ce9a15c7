"""3 prefill hosts x 2 decode hosts under 64 concurrent requests, one prefill host killed mid-run.

Every decode knows all three prefills. Prefill h1 holds each of its jobs for a moment before the
manifest (TEST-ONLY pause), so when the test SIGKILLs everything on that host (its PID namespace
goes with it), requests are in flight there. Decode sends those jobs (no manifest yet) to h0 or
h2; only a request reading from h1 could fail, with UNAVAILABLE naming prefill-h1; every other
request completes with its state verified, and each was served by h0 or h2 (their
read counters account for all of them). Afterwards nothing is held anywhere, decode has dropped
the dead host's agents, and a second wave completes on the survivors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.hosts.cluster import Cluster, HostService
from tests.hosts.conftest import namespaces_or_skip

pytestmark = [pytest.mark.hosts, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

REQUESTS = 64
HOLD_SECONDS = 1.5
COMMON = ["--model", "tiny-mamba2", "--engine", "synthetic", "--num-blocks", "256"]


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[Cluster, list[HostService], list[HostService]]]:
    namespaces_or_skip()
    with Cluster(5) as c:
        prefill_hosts, decode_hosts = c.hosts[:3], c.hosts[3:]
        targets = [arg for h in prefill_hosts for arg in ("--prefill", c.address("prefill", h))]
        hold = {"HYBRID_PD_TEST_PAUSE": f"before_manifest:{HOLD_SECONDS:g}"}
        services = c.start_many(
            *[
                ("prefill", h, [*COMMON, "--tp", "1", "--heartbeat-seconds", "0.5"], hold if i == 1 else {})
                for i, h in enumerate(prefill_hosts)
            ],
            *[
                ("decode", h, [*COMMON, "--tp", "2", "--check-state", "--read-timeout-seconds", "3", *targets])
                for h in decode_hosts
            ],
        )
        yield c, services[:3], services[3:]


async def reads(c: Cluster, prefill: HostService) -> float:
    return (await c.driver.metrics(prefill)).get("hybrid_pd_pins_ended_total{reason=read}", 0.0)


async def test_one_prefill_host_killed_under_load(pool: tuple[Cluster, list[HostService], list[HostService]]) -> None:
    c, (p0, p1, p2), decodes = pool
    d = c.driver
    for decode in decodes:
        await d.wait_serving(decode)
        while sum(p["state"] == "PEER_STATE_READY" for p in await d.peers(decode)) < 3:
            await asyncio.sleep(0.1)
    before = [await reads(c, p) for p in (p0, p2)]
    for decode in decodes:
        assert (await d.metrics(decode))["hybrid_pd_remote_agents"] == 6

    calls = [
        asyncio.ensure_future(d.generate(decodes[i % 2], f"load-{i}", list(range(1, 10 + i % 40)), 6)) for i in range(REQUESTS)
    ]
    deadline = time.monotonic() + 30
    while not any("TEST PAUSE before_manifest" in line for line in p1.output):
        assert time.monotonic() < deadline, p1.tail()
        await asyncio.sleep(0.01)
    p1.proc.kill()  # the host's first process: its PID namespace and every process in it go
    outcomes = await asyncio.gather(*calls)

    ok = [o for o in outcomes if o["status"] == "OK"]
    failed = [o for o in outcomes if o["status"] != "OK"]
    # Jobs h1 held before their manifest went to h0 or h2; only a READ from h1 could fail.
    retried = [(await d.metrics(decode)).get("hybrid_pd_prefill_retries_total{reason=PEER_UNAVAILABLE}", 0) for decode in decodes]
    assert sum(retried) > 0, "nothing was in flight on the killed host"
    for o in failed:
        assert o["status"] == "UNAVAILABLE" and "prefill-h1" in o["message"], o
    assert all(o["state_verified"] for o in ok)
    served = [await reads(c, p) - b for p, b in zip((p0, p2), before)]
    assert sum(served) == len(ok), f"h0 and h2 served {served}, {len(ok)} requests succeeded"
    print(
        f"\n[measured] {len(ok)} of {REQUESTS} completed (h0 {served[0]:.0f}, h2 {served[1]:.0f}); "
        f"{sum(retried):.0f} held by the killed host sent elsewhere, {len(failed)} failed"
    )

    for decode in decodes:
        for gauge in ("hybrid_pd_blocks_in_use", "hybrid_pd_open_read_handles", "hybrid_pd_requests_in_flight"):
            await d.wait_metric(decode, gauge, lambda v: v == 0)
        # Each decode rank adds each prefill rank's agent: 2 x 3 before, 2 x 2 once h1 is dropped.
        await d.wait_metric(decode, "hybrid_pd_remote_agents", lambda v: v == 4)
    for prefill in (p0, p2):
        await d.wait_metric(prefill, "hybrid_pd_blocks_in_use", lambda v: v == 0)
        await d.wait_metric(prefill, "hybrid_pd_pinned_requests", lambda v: v == 0)
    again = await asyncio.gather(*(d.generate(decodes[i % 2], f"after-{i}", list(range(1, 30)), 4) for i in range(16)))
    assert all(o["status"] == "OK" and o["state_verified"] for o in again), again
