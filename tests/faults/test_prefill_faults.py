"""The prefill peer fails, seen from decode: real processes, real NIXL, real signals.

One decode engine lives for the whole module. It starts before its prefill peer exists (peer
unreachable), then the prefill is SIGKILLed at each step of a request (before the manifest,
after the manifest but before the READ, after the READ) and restarted on the same port: decode
must fail only the affected request with UNAVAILABLE naming the peer, free its blocks, drop the
dead incarnation's agent, reconnect and handshake the new incarnation. Last, a decode engine is
SIGKILLed while prefill holds blocks for it: prefill frees them when the lease runs out.

The TEST-ONLY pause hook (HYBRID_PD_TEST_PAUSE, shared/runtime/faults.py) holds a request at
the step under test so the kill lands there. Times are measured and printed (run with -s);
bounds are generous on purpose.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.faults.harness import Outcome, Service, free_port, generate, peer_status, start, start_async

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(90)]

PREFILL_ID = "fault-prefill"
LEASE_SECONDS = 2.0
HEARTBEAT_SECONDS = 0.5
PREFILL_FLAGS = [
    "--engine-id", PREFILL_ID, "--num-blocks", "64",
    "--heartbeat-seconds", str(HEARTBEAT_SECONDS), "--lease-seconds", str(LEASE_SECONDS),
]  # fmt: skip
PREFILL_PAUSES = "before_manifest:30:before-manifest-"
DECODE_FLAGS = ["--engine-id", "fault-decode", "--num-blocks", "64", "--check-state", "--read-timeout-seconds", "5"]
DECODE_PAUSES = "before_read:30:before-read-,after_read:1:after-read-,before_read:30:slow-"
BOUND_SECONDS = 10.0  # generous: the suite shares two cores with other work


@dataclass
class Cluster:
    port: int
    decode: Service
    prefill: Service | None = None
    all_started: list[Service] = field(default_factory=list)

    async def start_prefill(self) -> Service:
        self.prefill = await start_async("prefill", *PREFILL_FLAGS, "--port", str(self.port), pauses=PREFILL_PAUSES)
        self.all_started.append(self.prefill)
        return self.prefill

    async def ready(self) -> Service:
        """A live prefill and a decode that is SERVING through it."""
        if self.prefill is None or self.prefill.process.proc.poll() is not None:
            await self.start_prefill()
        await self.decode.wait_serving()
        assert self.prefill is not None
        return self.prefill


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    port = free_port()
    decode = start("decode", *DECODE_FLAGS, "--prefill", f"127.0.0.1:{port}", pauses=DECODE_PAUSES)
    c = Cluster(port, decode, all_started=[decode])
    try:
        yield c
    finally:
        for service in c.all_started:
            service.kill()


def report(what: str, seconds: float) -> None:
    print(f"\n[measured] {what}: {seconds * 1000:.0f} ms", file=sys.stderr)


async def cli(*argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hybridpd_tools.cli.main", "generate", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def incarnation(decode: Service) -> int:
    (peer,) = await peer_status(decode)
    return int(peer.incarnation)


async def assert_decode_clean(decode: Service) -> None:
    """No blocks, no READ handle, no remote agent of a dead prefill left on decode."""
    await decode.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    await decode.wait_metric("hybrid_pd_open_read_handles", lambda v: v == 0)
    await decode.wait_metric("hybrid_pd_requests_in_flight", lambda v: v == 0)


async def recover(c: Cluster, old_incarnation: int) -> None:
    """The dead incarnation's agent is dropped; a restarted prefill is handshaken and used."""
    await c.decode.wait_metric("hybrid_pd_remote_agents", lambda v: v == 0)
    prefill = await c.start_prefill()
    report("decode SERVING again after the prefill restarted", await c.decode.wait_serving())
    new = await incarnation(c.decode)
    assert new != old_incarnation
    # Exactly one remote agent: the old one was removed before the new one was added.
    assert (await c.decode.metrics())["hybrid_pd_remote_agents"] == 1
    ok = await generate(c.decode.address, f"after-restart-{new:x}")
    assert ok.status == "OK", ok
    assert ok.summary is not None and ok.summary.state_verified  # bytes of the new incarnation
    await prefill.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)


async def kill_prefill_at(c: Cluster, request_id: str, watched: Service, pause_line: str) -> tuple[Outcome, float, int]:
    prefill = await c.ready()
    old = await incarnation(c.decode)
    call = asyncio.ensure_future(generate(c.decode.address, request_id))
    await watched.wait_line(pause_line)
    killed = time.monotonic()
    prefill.kill()
    outcome = await call
    return outcome, time.monotonic() - killed, old


def assert_names_prefill(outcome: Outcome, port: int) -> None:
    assert outcome.status == "UNAVAILABLE", outcome
    assert PREFILL_ID in outcome.message and f"127.0.0.1:{port}" in outcome.message, outcome


async def test_prefill_unreachable_at_start(cluster: Cluster) -> None:
    c = cluster
    assert await c.decode.health() == "NOT_SERVING"
    assert await c.decode.health("") == "SERVING"  # liveness does not depend on peers
    outcome = await generate(c.decode.address, "unreachable-1")
    assert outcome.status == "UNAVAILABLE" and "no prefill engine is ready" in outcome.message, outcome
    assert f"127.0.0.1:{c.port}" in outcome.message
    assert outcome.seconds < BOUND_SECONDS
    report("Generate answered UNAVAILABLE with no prefill reachable", outcome.seconds)
    for _ in range(200):  # the peer loop records why it cannot connect, and keeps retrying
        (peer,) = await peer_status(c.decode)
        if peer.last_error:
            break
        await asyncio.sleep(0.05)
    assert "UNAVAILABLE" in peer.last_error, peer
    code, err = await cli("--decode", c.decode.address, "--prompt-ids", "1,2,3", "--max-tokens", "2")
    assert code == 1 and err.startswith("UNAVAILABLE: no prefill engine is ready"), err
    assert (await c.decode.metrics())["hybrid_pd_blocks_in_use"] == 0

    await c.start_prefill()
    report("decode SERVING after its prefill came up", await c.decode.wait_serving())
    ok = await generate(c.decode.address, "first-1")
    assert ok.status == "OK" and len(ok.tokens) == 8 and ok.summary is not None and ok.summary.state_verified, ok


async def test_prefill_killed_before_the_manifest(cluster: Cluster) -> None:
    c = cluster
    prefill = await c.ready()
    outcome, seconds, old = await kill_prefill_at(c, "before-manifest-1", prefill, "TEST PAUSE before_manifest before-manifest-1")
    assert_names_prefill(outcome, c.port)
    assert seconds < BOUND_SECONDS
    report("prefill SIGKILLed before the manifest -> client UNAVAILABLE", seconds)
    await assert_decode_clean(c.decode)
    await recover(c, old)


async def test_prefill_killed_after_the_manifest_before_the_read(cluster: Cluster) -> None:
    c = cluster
    await c.ready()
    outcome, seconds, old = await kill_prefill_at(c, "before-read-1", c.decode, "TEST PAUSE before_read before-read-1")
    assert_names_prefill(outcome, c.port)
    assert seconds < BOUND_SECONDS
    report("prefill SIGKILLed after the manifest, before the READ -> client UNAVAILABLE", seconds)
    await assert_decode_clean(c.decode)
    await recover(c, old)


async def test_prefill_killed_after_the_read_does_not_fail_the_request(cluster: Cluster) -> None:
    c = cluster
    await c.ready()
    outcome, _seconds, old = await kill_prefill_at(c, "after-read-1", c.decode, "TEST PAUSE after_read after-read-1")
    # The state is already here: the request is not affected.
    assert outcome.status == "OK" and len(outcome.tokens) == 8, outcome
    assert outcome.summary is not None and outcome.summary.state_verified
    await assert_decode_clean(c.decode)
    await recover(c, old)


async def test_decode_killed_with_blocks_pinned_on_prefill(cluster: Cluster) -> None:
    c = cluster
    prefill = await c.ready()
    before = await prefill.metrics()
    doomed = await start_async(
        "decode", "--engine-id", "doomed-decode", "--num-blocks", "64", "--prefill", prefill.address,
        pauses="before_read:30:pinned-",
    )  # fmt: skip
    c.all_started.append(doomed)
    await doomed.wait_serving()
    await prefill.wait_metric("hybrid_pd_sessions", lambda v: v == 2)
    call = asyncio.ensure_future(generate(doomed.address, "pinned-1"))
    await doomed.wait_line("TEST PAUSE before_read pinned-1")
    assert (await prefill.metrics())["hybrid_pd_pinned_requests"] == 1
    assert await prefill.blocks_in_use() > 0
    killed = time.monotonic()
    doomed.kill()
    assert (await call).status == "UNAVAILABLE"
    # The broken stream alone frees nothing (a decode engine may still be reading): the lease does.
    await prefill.wait_metric("hybrid_pd_sessions", lambda v: v == 1)
    assert (await prefill.metrics())["hybrid_pd_pinned_requests"] == 1
    await prefill.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0, timeout=BOUND_SECONDS)
    freed_after = time.monotonic() - killed
    report(f"decode SIGKILLed -> prefill freed its blocks at lease expiry (lease {LEASE_SECONDS:g} s)", freed_after)
    after = await prefill.metrics()
    assert after["hybrid_pd_lease_expiries_total"] - before["hybrid_pd_lease_expiries_total"] == 1
    assert after["hybrid_pd_pinned_requests"] == 0
    # The dead decode engine's session is forgotten; the other decode engine keeps being served.
    assert after["hybrid_pd_sessions"] == 1 and after["hybrid_pd_decode_peers"] == 1
    ok = await generate(c.decode.address, "survivor-1")
    assert ok.status == "OK", ok


async def test_client_cli_prints_status_and_exits_nonzero(cluster: Cluster) -> None:
    c = cluster
    await c.ready()
    address = ["--decode", c.decode.address]
    code, err = await cli(*address, "--prompt-ids", "1,2", "--max-tokens", "1000000")  # more than the cache holds
    assert code == 1 and err.startswith("INVALID_ARGUMENT: max_tokens"), err
    code, err = await cli(*address, "--prompt-ids", "1,999999", "--max-tokens", "2")
    assert code == 1 and err.startswith("INVALID_ARGUMENT: prompt_token_ids"), err
    code, err = await cli(*address, "--prompt-ids", "1,2", "--max-tokens", "2", "--request-id", "slow-1", "--timeout", "1")
    assert code == 1 and err.startswith("DEADLINE_EXCEEDED"), err
    code, err = await cli("--decode", f"127.0.0.1:{free_port()}", "--prompt-ids", "1", "--max-tokens", "1", "--timeout", "5")
    assert code == 1 and err.startswith("UNAVAILABLE"), err
    # The deadline-exceeded request was cancelled on both sides.
    await assert_decode_clean(c.decode)
    assert c.prefill is not None
    await c.prefill.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
