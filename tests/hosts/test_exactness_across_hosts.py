"""Disaggregated == colocated, bit for bit, with prefill and decode on different hosts.

Each reference family, and the paged engine on a tiny nemotron_h checkpoint (the batched engine,
at its full-N boundary), runs one prefill and one decode on two namespace hosts
(hybridpd_tools/bench/netns.py) at a heterogeneous TP pair; UCX is limited to TCP over the hosts' eth0, so every byte crosses
the bridge. Decode checks the state it read (`--check-state`), the tokens must equal a colocated
run, and the kernel's own TCP counters on the decode host must show at least the transferred
bytes arriving from the prefill host outside gRPC: the data plane really went over the link.
A last test shapes one link (netem: 10 Gbit/s, 100 us each way; a kernel without netem gets a
token bucket for the rate alone, and the test says so) and repeats a family over it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from hybridpd_tools.bench.netns import Host
from shared.layout.page import build_engine_layout
from tests.hosts.cluster import Cluster, HostService, data_plane_connections, qdisc_bytes_sent
from tests.hosts.conftest import namespaces_or_skip
from tests.integration.exactness.subjects import Subject

pytestmark = [pytest.mark.hosts, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]

# (subject, prefill TP, decode TP): every reference family once, TP up and down, n_groups = 1
# split both ways; the paged engine once, its n_groups = 1 split on decode.
PAIRS = [
    (Subject("reference", "tiny-mamba2"), 1, 2),
    (Subject("reference", "tiny-mamba2-g1"), 2, 4),
    (Subject("reference", "tiny-gdn"), 4, 1),
    (Subject("reference", "tiny-mamba1"), 2, 1),
    (Subject("paged", "nemotron_h"), 1, 2),
]
TEXT = bytes(range(32, 127)) * 3
SHAPED = {"rate": "10gbit", "delay": "100us"}
# UCX's TCP listening ports pinned to a range, as a firewall would need (docs/deploy.md).
UCX_PORTS = range(41000, 41100)
UCX_PORT_ENV = {"UCX_TCP_PORT_RANGE": f"{UCX_PORTS.start}-{UCX_PORTS.stop - 1}"}


def prompt_of(length: int) -> list[int]:
    return list(TEXT[:length])


def lengths(subject: Subject, prefill_tp: int) -> list[int]:
    bs = build_engine_layout(subject.spec, prefill_tp).block_size
    return [1, 2, 3, bs - 1, bs, bs + 1, 2 * bs + 5]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, dict[str, tuple[HostService, HostService]]]]:
    namespaces_or_skip()
    with Cluster(2 * len(PAIRS)) as c:
        specs: list[tuple[str, Host, list[str], dict[str, str]]] = []
        for i, (subject, p, d) in enumerate(PAIRS):
            prefill_host, decode_host = c.hosts[2 * i], c.hosts[2 * i + 1]
            common = ["--model", subject.model, "--engine", subject.engine, "--num-blocks", "96"]
            specs.append(("prefill", prefill_host, [*common, "--tp", str(p)], UCX_PORT_ENV))
            specs.append(
                (
                    "decode",
                    decode_host,
                    [*common, "--tp", str(d), "--check-state", "--prefill", c.address("prefill", prefill_host)],
                    UCX_PORT_ENV,
                )
            )
        services = c.start_many(*specs)
        yield c, {subject.id: (services[2 * i], services[2 * i + 1]) for i, (subject, _, _) in enumerate(PAIRS)}


async def run_family(c: Cluster, subject: Subject, prefill_tp: int, decode_tp: int, decode: HostService, tag: str) -> None:
    await c.driver.wait_serving(decode)
    max_tokens = build_engine_layout(subject.spec, decode_tp).block_size + 2
    ns = lengths(subject, prefill_tp)
    results = await asyncio.gather(*(c.driver.generate(decode, f"{tag}-{n}", prompt_of(n), max_tokens) for n in ns))
    for n, got in zip(ns, results):
        assert got["status"] == "OK", f"prompt of {n}: {got['status']} {got['message']}\n{decode.tail()}"
        assert got["state_verified"], f"prompt of {n}: decode did not verify the transferred state"
        assert got["num_transferred_tokens"] == subject.computed(n)
        assert got["tokens"] == await subject.expected(prompt_of(n), max_tokens), f"prompt of {n} tokens"


def transferred(samples: dict[str, float]) -> float:
    return sum(v for k, v in samples.items() if k.startswith("hybrid_pd_transferred_bytes_total{"))


@pytest.mark.parametrize("subject,prefill_tp,decode_tp", PAIRS, ids=[f"{s.name}-P{p}-D{d}" for s, p, d in PAIRS])
async def test_tokens_equal_colocated_across_hosts(
    cluster: tuple[Cluster, dict[str, tuple[HostService, HostService]]], subject: Subject, prefill_tp: int, decode_tp: int
) -> None:
    c, services = cluster
    prefill, decode = services[subject.id]
    await run_family(c, subject, prefill_tp, decode_tp, decode, "x")
    moved = transferred(await c.driver.metrics(decode))
    assert moved > 0
    connections = data_plane_connections(decode.host, prefill.host)
    received = sum(conn.bytes_received for conn in connections)
    assert received >= moved, f"only {received} B arrived over TCP from the prefill host for {moved:.0f} B transferred"
    # One end of every data-plane connection is a UCX listener, inside the pinned range.
    assert connections and all(conn.remote_port in UCX_PORTS or conn.local_port in UCX_PORTS for conn in connections), connections
    await c.driver.wait_metric(prefill, "hybrid_pd_blocks_in_use", lambda v: v == 0)
    await c.driver.wait_metric(decode, "hybrid_pd_blocks_in_use", lambda v: v == 0)


async def test_exact_over_a_shaped_link(cluster: tuple[Cluster, dict[str, tuple[HostService, HostService]]]) -> None:
    c, services = cluster
    subject, prefill_tp, decode_tp = PAIRS[1]
    prefill, decode = services[subject.id]
    kind = prefill.host.shape(**SHAPED)
    print(f"shaped with {kind}: {SHAPED}" + ("" if kind == "netem" else " (no netem in this kernel: rate only)"))
    assert kind in ("netem", "tbf")
    try:
        before = qdisc_bytes_sent(prefill.host)
        moved_before = transferred(await c.driver.metrics(decode))
        await run_family(c, subject, prefill_tp, decode_tp, decode, "shaped")
        moved = transferred(await c.driver.metrics(decode)) - moved_before
        through_shaper = qdisc_bytes_sent(prefill.host) - before
    finally:
        prefill.host.unshape()
    assert moved > 0
    # The prefill host sends every transferred byte, so all of it went through its netem qdisc.
    assert through_shaper >= moved, f"{through_shaper} B through the shaper for {moved:.0f} B transferred"
