"""One of two prefill peers dies: only its requests fail; decode keeps serving through the other."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.faults.harness import Service, Spec, free_port, generate, start_many

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def trio() -> Iterator[tuple[Service, Service, Service]]:
    a, b = free_port(), free_port()
    started = start_many(
        Spec("prefill", ("--engine-id", "peer-a", "--num-blocks", "64", "--port", str(a)), pauses="before_manifest:30:victim-"),
        Spec("prefill", ("--engine-id", "peer-b", "--num-blocks", "64", "--port", str(b))),
        Spec(
            "decode",
            ("--engine-id", "two-peer-decode", "--num-blocks", "128", "--check-state",
             "--prefill", f"127.0.0.1:{a}", "--prefill", f"127.0.0.1:{b}"),
        ),
    )  # fmt: skip
    try:
        yield started[0], started[1], started[2]
    finally:
        for service in started:
            service.kill()


async def test_only_the_dead_peers_requests_fail(trio: tuple[Service, Service, Service]) -> None:
    doomed, steady, decode = trio
    await decode.wait_serving()
    await decode.wait_metric("hybrid_pd_prefill_peers_ready", lambda v: v == 2)
    # Round-robin: half of these land on peer-a (and wait there), half complete on peer-b.
    calls = [asyncio.ensure_future(generate(decode.address, f"victim-{i}")) for i in range(6)]
    await doomed.wait_line("TEST PAUSE before_manifest victim-")
    await steady.wait_metric("hybrid_pd_pins_ended_total{reason=read}", lambda v: v >= 1)
    doomed.kill()
    outcomes = await asyncio.gather(*calls)
    failed = [o for o in outcomes if o.status != "OK"]
    served = [o for o in outcomes if o.status == "OK"]
    assert failed and served, outcomes
    for o in failed:
        assert o.status == "UNAVAILABLE" and "peer-a" in o.message and "peer-b" not in o.message, o
    for o in served:
        assert o.summary is not None and o.summary.prefill_engine_id == "peer-b" and o.summary.state_verified
    await decode.wait_metric("hybrid_pd_prefill_peers_ready", lambda v: v == 1)
    after = await asyncio.gather(*(generate(decode.address, f"after-{i}") for i in range(8)))
    assert all(o.status == "OK" for o in after), after
    assert await decode.health() == "SERVING"  # one ready peer is enough
    await decode.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    await steady.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    await decode.wait_metric("hybrid_pd_remote_agents", lambda v: v == 1)  # peer-a's agent dropped
