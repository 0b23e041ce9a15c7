"""The prefill host's cable pulled while a READ is in flight, then plugged back in.

`ip link set ... down` on the prefill host's bridge port: no RST, no FIN, packets just stop, as on
a pulled cable or a partition. The TEST-ONLY pause hook holds the request just before its READ;
the test cuts the link in that moment, so the READ is posted into the dead link (the open READ
handle gauge shows it in flight). Heartbeats are slow here (10 s), so only decode's READ deadline
can end it: the client gets UNAVAILABLE within BOUND_SECONDS of the cut, decode's blocks and READ
handles are free at once, prefill's blocks are free once its lease expires (read after the link
is back, since its metrics are behind the cut too), and the same pair serves exact requests again.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator

import pytest

from tests.hosts.cluster import Cluster, HostService
from tests.hosts.conftest import namespaces_or_skip

pytestmark = [pytest.mark.hosts, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

PAUSE_SECONDS = 1.0
READ_TIMEOUT_SECONDS = 2.0
LEASE_SECONDS = 3.0
# The pause left after the cut, the READ deadline, and slack for a loaded 2-core machine.
BOUND_SECONDS = PAUSE_SECONDS + READ_TIMEOUT_SECONDS + 3.0
PREFILL_TP = 2
COMMON = ["--model", "tiny-mamba2", "--engine", "synthetic", "--num-blocks", "64"]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Cluster, HostService, HostService]]:
    namespaces_or_skip()
    with Cluster(2) as c:
        prefill_host, decode_host = c.hosts
        prefill, decode = c.start_many(
            (
                "prefill",
                prefill_host,
                [*COMMON, "--tp", str(PREFILL_TP), "--heartbeat-seconds", "10", "--lease-seconds", str(LEASE_SECONDS)],
            ),
            (
                "decode",
                decode_host,
                [
                    *COMMON,
                    "--tp",
                    "1",
                    "--check-state",
                    "--read-timeout-seconds",
                    str(READ_TIMEOUT_SECONDS),
                    "--prefill",
                    c.address("prefill", prefill_host),
                ],
                {"HYBRID_PD_TEST_PAUSE": f"before_read:{PAUSE_SECONDS:g}:cut-"},
            ),
        )
        yield c, prefill, decode


async def wait_line(service: HostService, needle: str, start: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(needle in line for line in service.output[start:]):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"no {needle!r} from {service.role}\n{service.tail()}")


async def test_link_cut_during_a_read(pair: tuple[Cluster, HostService, HostService]) -> None:
    c, prefill, decode = pair
    d = c.driver
    await d.wait_serving(decode)
    warm = await d.generate(decode, "warm-1", list(range(1, 30)), 8)
    assert warm["status"] == "OK" and warm["state_verified"], warm

    mark = len(decode.output)
    call = asyncio.ensure_future(d.generate(decode, "cut-1", list(range(1, 30)), 8))
    await wait_line(decode, "TEST PAUSE before_read cut-1", mark)
    prefill.host.link(up=False)
    cut = time.monotonic()
    try:
        # One READ per (decode rank, prefill rank): PREFILL_TP handles in flight into the dead link.
        await d.wait_metric(decode, "hybrid_pd_open_read_handles", lambda v: v == PREFILL_TP, timeout=5)
        outcome = await call
        seconds = time.monotonic() - cut
        assert outcome["status"] == "UNAVAILABLE", outcome
        assert "prefill-h0" in outcome["message"], outcome  # names the peer
        assert seconds < BOUND_SECONDS, f"UNAVAILABLE after {seconds:.1f} s (bound {BOUND_SECONDS:g} s)"
        print(
            f"\n[measured] link cut during a READ -> UNAVAILABLE after {seconds * 1000:.0f} ms "
            f"(READ deadline {READ_TIMEOUT_SECONDS:g} s, bound {BOUND_SECONDS:g} s)",
            file=sys.stderr,
        )
        for gauge in ("hybrid_pd_blocks_in_use", "hybrid_pd_open_read_handles", "hybrid_pd_reads_in_flight"):
            await d.wait_metric(decode, gauge, lambda v: v == 0)
        await asyncio.sleep(LEASE_SECONDS)  # prefill hears nothing while the link is down
    finally:
        prefill.host.link(up=True)
    await d.wait_metric(prefill, "hybrid_pd_blocks_in_use", lambda v: v == 0)  # one gauge: every rank holds the same ids
    await d.wait_metric(prefill, "hybrid_pd_pinned_requests", lambda v: v == 0)
    # Freed by its lease: prefill never heard of the READ across the cut.
    assert (await d.metrics(prefill))["hybrid_pd_lease_expiries_total"] >= 1
    await d.wait_serving(decode)
    after = await asyncio.gather(*(d.generate(decode, f"after-{i}", list(range(1, 20 + i)), 8) for i in range(4)))
    for got in after:
        assert got["status"] == "OK" and got["state_verified"], got
    await d.wait_metric(prefill, "hybrid_pd_blocks_in_use", lambda v: v == 0)
