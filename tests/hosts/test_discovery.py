"""`--prefill NAME:PORT` follows what a real DNS server says, as with a Kubernetes headless Service.

dnsmasq on the client host answers `prefill.hpd.test`; decode (its own resolver pointing there)
re-resolves every DISCOVERY_SECONDS. The name starts with one prefill; a second address added to
it becomes a second peer that serves requests; an address removed while one of its requests is
held in prefill (TEST-ONLY pause before the manifest) is drained: that request completes, then the
peer is dropped (session closed, its NIXL agents removed) and every new request goes to the other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.hosts.cluster import PORTS, Cluster, HostService
from tests.hosts.conftest import namespaces_or_skip
from tests.hosts.dns import DnsServer, why_no_dnsmasq

pytestmark = [pytest.mark.hosts, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

NAME = "prefill.hpd.test"
DISCOVERY_SECONDS = 0.5
HOLD_SECONDS = 3.0
COMMON = ["--model", "tiny-mamba2", "--engine", "synthetic", "--num-blocks", "64", "--tp", "1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, DnsServer, list[HostService], HostService]]:
    namespaces_or_skip()
    reason = why_no_dnsmasq()
    if reason is not None:
        pytest.skip(f"discovery: {reason}")
    with Cluster(3) as c:
        dns = DnsServer(c.network, c.client, tmp_path_factory.mktemp("dns"))
        a, b, decode_host = c.hosts
        dns.set(NAME, [a.address])
        hold = {"HYBRID_PD_TEST_PAUSE": f"before_manifest:{HOLD_SECONDS:g}:hold-"}
        prefill_a, prefill_b = c.start_many(("prefill", a, COMMON, hold), ("prefill", b, COMMON, hold))
        decode = c.start(
            "decode",
            decode_host,
            *COMMON,
            "--check-state",
            "--prefill",
            f"{NAME}:{PORTS['prefill']}",
            "--discovery-seconds",
            str(DISCOVERY_SECONDS),
            resolv_conf=dns.resolv_conf,
        )
        yield c, dns, [prefill_a, prefill_b], decode


async def wait_peers(c: Cluster, decode: HostService, expected: set[str], timeout: float = 20.0) -> list[dict[str, Any]]:
    """Until decode's peers are exactly `expected` (addresses), all READY."""
    deadline = time.monotonic() + timeout
    peers: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        peers = await c.driver.peers(decode)
        if {p["target"] for p in peers} == expected and all(p["state"] == "PEER_STATE_READY" for p in peers):
            return peers
        await asyncio.sleep(0.1)
    raise AssertionError(f"peers {peers}, expected {sorted(expected)} READY\n{decode.tail()}")


async def reads_served(c: Cluster, prefill: HostService) -> float:
    return (await c.driver.metrics(prefill)).get("hybrid_pd_pins_ended_total{reason=read}", 0.0)


async def test_prefills_added_and_removed_in_dns(setup: tuple[Cluster, DnsServer, list[HostService], HostService]) -> None:
    c, dns, (a, b), decode = setup
    d = c.driver
    await d.wait_serving(decode)
    await wait_peers(c, decode, {a.address})

    # Added: a second address under the name becomes a second peer, and it serves requests.
    dns.set(NAME, [a.host.address, b.host.address])
    await wait_peers(c, decode, {a.address, b.address})
    results = await asyncio.gather(*(d.generate(decode, f"two-{i}", list(range(1, 20)), 4) for i in range(6)))
    assert all(r["status"] == "OK" and r["state_verified"] for r in results), results
    assert await reads_served(c, a) > 0 and await reads_served(c, b) > 0

    # Removed while one of its requests is held in prefill A: it finishes, then A is dropped.
    a_before = await reads_served(c, a)
    held = [asyncio.ensure_future(d.generate(decode, f"hold-{i}", list(range(1, 20)), 4)) for i in range(2)]
    await d.wait_metric(a, "hybrid_pd_sessions", lambda v: v == 1)
    deadline = time.monotonic() + 10
    while not any("TEST PAUSE before_manifest hold-" in line for line in a.output):
        assert time.monotonic() < deadline, a.tail()
        await asyncio.sleep(0.02)
    dns.set(NAME, [b.host.address])
    await wait_peers(c, decode, {b.address})  # out of the rotation at once
    outcomes = await asyncio.gather(*held)
    assert all(r["status"] == "OK" and r["state_verified"] for r in outcomes), outcomes  # drained, not cut
    assert await reads_served(c, a) == a_before + 1
    await d.wait_metric(a, "hybrid_pd_sessions", lambda v: v == 0)  # then dropped
    await d.wait_metric(decode, "hybrid_pd_remote_agents", lambda v: v == 1)  # B's one rank
    b_before = await reads_served(c, b)
    results = await asyncio.gather(*(d.generate(decode, f"one-{i}", list(range(1, 20)), 4) for i in range(4)))
    assert all(r["status"] == "OK" for r in results), results
    assert await reads_served(c, b) == b_before + 4 and await reads_served(c, a) == a_before + 1
    for prefill in (a, b):
        await d.wait_metric(prefill, "hybrid_pd_blocks_in_use", lambda v: v == 0)
