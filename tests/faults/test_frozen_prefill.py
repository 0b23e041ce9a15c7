"""A prefill that freezes (SIGSTOP) or dies while a READ is in flight.

On one host NIXL moves DRAM with cma (process_vm_readv) and shared-memory messages, which need
nothing from the peer process: a READ from a frozen peer simply completes. Over a network
(RDMA, TCP) a READ needs the peer's side to make progress, and a frozen peer leaves it in
flight forever. These tests run both services with `UCX_TLS=tcp` so the READ takes the network
path: then only decode's READ deadline (or heartbeat silence) can end it.

The TEST-ONLY pause hook holds each request for a moment before its READ; the test freezes
prefill in that moment, so the READ is posted to a frozen peer (the open READ handle gauge
shows it in flight).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.faults.harness import Outcome, Service, Spec, free_port, generate, start_async, start_many

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(90)]

PREFILL_ID = "frozen-prefill"
NETWORK_PATH = {"UCX_TLS": "tcp"}
READ_TIMEOUT_SECONDS = 2.0
# First phase: heartbeats so slow that only the READ deadline can end a frozen READ.
SLOW_HEARTBEAT = ["--heartbeat-seconds", "10"]
# Second phase: heartbeats that detect a frozen peer.
FAST_HEARTBEAT_SECONDS = 0.5
BOUND_SECONDS = 10.0


def prefill_flags(port: int, heartbeat: list[str]) -> list[str]:
    return ["--engine-id", PREFILL_ID, "--num-blocks", "64", "--lease-seconds", "30", "--port", str(port), *heartbeat]


@dataclass
class Frozen:
    port: int
    decode: Service
    prefill: Service
    all_started: list[Service] = field(default_factory=list)


@pytest.fixture(scope="module")
def frozen() -> Iterator[Frozen]:
    port = free_port()
    prefill, decode = start_many(
        Spec("prefill", tuple(prefill_flags(port, SLOW_HEARTBEAT)), pauses="before_manifest:30:silent-", env=NETWORK_PATH),
        Spec(
            "decode",
            ("--engine-id", "frozen-decode", "--num-blocks", "64", "--prefill", f"127.0.0.1:{port}",
             "--read-timeout-seconds", str(READ_TIMEOUT_SECONDS)),
            pauses="before_read:1:hold-",
            env=NETWORK_PATH,
        ),
    )  # fmt: skip
    f = Frozen(port, decode, prefill, [prefill, decode])
    try:
        yield f
    finally:
        for service in f.all_started:
            service.kill()


def report(what: str, seconds: float) -> None:
    print(f"\n[measured] {what}: {seconds * 1000:.0f} ms", file=sys.stderr)


async def freeze_during_read(f: Frozen, request_id: str) -> asyncio.Future[Outcome]:
    """Start a request, SIGSTOP prefill while the request waits to READ, return once the READ
    is posted (in flight to the frozen peer)."""
    await f.decode.wait_serving()
    mark = len(f.decode.output)
    call = asyncio.ensure_future(generate(f.decode.address, request_id))
    await f.decode.wait_line(f"TEST PAUSE before_read {request_id}", start=mark)
    f.prefill.signal(signal.SIGSTOP)
    await f.decode.wait_metric("hybrid_pd_open_read_handles", lambda v: v == 1, timeout=5)
    return call


async def thaw_and_check_prefill_frees(f: Frozen) -> None:
    f.prefill.signal(signal.SIGCONT)
    await f.prefill.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    await f.prefill.wait_metric("hybrid_pd_pinned_requests", lambda v: v == 0)


async def assert_decode_clean(decode: Service) -> None:
    await decode.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    await decode.wait_metric("hybrid_pd_open_read_handles", lambda v: v == 0)
    await decode.wait_metric("hybrid_pd_reads_in_flight", lambda v: v == 0)


async def test_read_from_a_frozen_prefill_ends_at_the_read_deadline(frozen: Frozen) -> None:
    f = frozen
    await f.decode.wait_serving()
    ok = await generate(f.decode.address, "warm-1")
    assert ok.status == "OK", ok
    call = await freeze_during_read(f, "hold-frozen-1")
    posted = time.monotonic()
    outcome = await call
    ended = time.monotonic() - posted
    assert outcome.status == "UNAVAILABLE" and "timed out" in outcome.message, outcome
    assert PREFILL_ID in outcome.message
    assert ended < BOUND_SECONDS
    report(f"READ to a SIGSTOPped prefill ended by its deadline ({READ_TIMEOUT_SECONDS:g} s)", ended)
    await assert_decode_clean(f.decode)
    await thaw_and_check_prefill_frees(f)  # decode's release reaches it once it runs again
    assert (await generate(f.decode.address, "after-thaw-1")).status == "OK"


async def test_client_cancel_releases_an_in_flight_read(frozen: Frozen) -> None:
    f = frozen
    call = await freeze_during_read(f, "hold-cancel-1")
    cancelled = time.monotonic()
    call.cancel()
    await assert_decode_clean(f.decode)
    report("client cancel with a READ in flight -> handle released, decode blocks free", time.monotonic() - cancelled)
    await thaw_and_check_prefill_frees(f)


async def test_prefill_killed_during_the_read(frozen: Frozen) -> None:
    f = frozen
    call = await freeze_during_read(f, "hold-killed-1")
    killed = time.monotonic()
    f.prefill.kill()
    outcome = await call
    seconds = time.monotonic() - killed
    assert outcome.status == "UNAVAILABLE" and PREFILL_ID in outcome.message, outcome
    assert seconds < BOUND_SECONDS
    report("prefill SIGKILLed during the READ -> client UNAVAILABLE", seconds)
    await assert_decode_clean(f.decode)
    await f.decode.wait_metric("hybrid_pd_remote_agents", lambda v: v == 0)
    # Back with fast heartbeats for the next test.
    f.prefill = await start_async(
        "prefill", *prefill_flags(f.port, ["--heartbeat-seconds", str(FAST_HEARTBEAT_SECONDS)]),
        pauses="before_manifest:30:silent-", env=NETWORK_PATH,
    )  # fmt: skip
    f.all_started.append(f.prefill)
    await f.decode.wait_serving()
    assert (await generate(f.decode.address, "after-restart-1")).status == "OK"


async def test_frozen_prefill_is_dropped_within_two_heartbeat_intervals(frozen: Frozen) -> None:
    f = frozen
    await f.decode.wait_serving()
    mark = len(f.prefill.output)
    call = asyncio.ensure_future(generate(f.decode.address, "silent-1"))
    await f.prefill.wait_line("TEST PAUSE before_manifest silent-1", start=mark)
    f.prefill.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    outcome = await call
    seconds = time.monotonic() - stopped
    assert outcome.status == "UNAVAILABLE" and "stopped answering" in outcome.message, outcome
    assert PREFILL_ID in outcome.message
    assert seconds < BOUND_SECONDS
    report(
        f"SIGSTOPped prefill detected by heartbeat silence (interval {FAST_HEARTBEAT_SECONDS:g} s, "
        f"{seconds / FAST_HEARTBEAT_SECONDS:.2f} intervals)",
        seconds,
    )
    await assert_decode_clean(f.decode)
    assert await f.decode.health() == "NOT_SERVING"
    # Thawed, it is the same incarnation: decode reconnects; the cancelled job's blocks are freed.
    f.prefill.signal(signal.SIGCONT)
    report("decode SERVING again after the prefill was thawed", await f.decode.wait_serving())
    await f.prefill.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    assert (await generate(f.decode.address, "after-silence-1")).status == "OK"
