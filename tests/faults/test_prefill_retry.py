"""Two prefill peers, one of which fails: a job it fails before its manifest (TEST-ONLY status
injected, or the process SIGKILLed while the job is held) is sent to the other prefill and the
request succeeds there with the same tokens; a request whose manifest had arrived is not retried
and fails UNAVAILABLE naming the dead peer. Controls: a decode engine that knows only the failing
prefill fails each such request with the status it failed with. Nothing stays held anywhere."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.faults.harness import Outcome, Service, Spec, free_port, generate, start_many

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]

PROMPT = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3)
READ_HOLD_SECONDS = 10  # decode holds `late-` requests between manifest and READ this long
RETRIES = "hybrid_pd_prefill_retries_total{reason=%s}"


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[Service, Service, Service, Service]]:
    a, b = free_port(), free_port()
    started = start_many(
        Spec(
            "prefill",
            ("--engine-id", "peer-a", "--num-blocks", "64", "--port", str(a)),
            pauses="before_manifest:30:victim-",
            env={"HYBRID_PD_TEST_FAIL": "RESOURCE_EXHAUSTED:full-"},
        ),
        Spec("prefill", ("--engine-id", "peer-b", "--num-blocks", "64", "--port", str(b))),
        Spec(
            "decode",
            ("--engine-id", "two-peer-decode", "--num-blocks", "128", "--check-state",
             "--prefill", f"127.0.0.1:{a}", "--prefill", f"127.0.0.1:{b}"),
            pauses=f"before_read:{READ_HOLD_SECONDS}:late-",
        ),
        Spec("decode", ("--engine-id", "solo-decode", "--num-blocks", "64", "--check-state", "--prefill", f"127.0.0.1:{a}")),
    )  # fmt: skip
    try:
        yield started[0], started[1], started[2], started[3]
    finally:
        for service in started:
            service.kill()


def jobs_logged(prefill: Service, prefix: str, status: str) -> int:
    return sum(f"job {prefix}" in line and f"finished: {status}" in line for line in prefill.output)


async def reference(decode: Service) -> list[int]:
    """What PROMPT decodes to when nothing fails (the synthetic engine is deterministic)."""
    ref = await generate(decode.address, "reference", PROMPT)
    assert ref.status == "OK", ref
    return ref.tokens


def served_by_b(o: Outcome, tokens: list[int]) -> bool:
    return o.status == "OK" and o.summary is not None and o.summary.prefill_engine_id == "peer-b" and o.tokens == tokens


async def test_a_job_failed_before_its_manifest_succeeds_on_the_other_prefill(
    services: tuple[Service, Service, Service, Service],
) -> None:
    flaky, steady, decode, solo = services
    for d in (decode, solo):
        await d.wait_serving()
    await decode.wait_metric("hybrid_pd_prefill_peers_ready", lambda v: v == 2)
    tokens = await reference(decode)
    # peer-a pins nothing (each of its jobs fails), so it is never less preferred: it gets most of these first.
    outcomes = [await generate(decode.address, f"full-{i}", PROMPT) for i in range(4)]
    assert all(served_by_b(o, tokens) and o.summary is not None and o.summary.state_verified for o in outcomes), outcomes
    failed_on_a = jobs_logged(flaky, "full-", "RESOURCE_EXHAUSTED")
    assert failed_on_a >= 1, flaky.tail()
    metrics = await decode.metrics()
    assert metrics[RETRIES % "RESOURCE_EXHAUSTED"] == failed_on_a
    assert metrics["hybrid_pd_requests_total{status=OK}"] == 5

    # Control: with no other prefill the request fails with the status peer-a failed it with.
    alone = await generate(solo.address, "full-solo", PROMPT)
    assert alone.status == "RESOURCE_EXHAUSTED" and "peer-a" in alone.message and "TEST-ONLY" in alone.message, alone
    assert (await solo.metrics())[RETRIES % "RESOURCE_EXHAUSTED"] == 0
    for service in (decode, solo, flaky, steady):
        await service.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)


async def until_one_lands(service: Service, line: str, call: asyncio.Future[Outcome]) -> bool:
    """Wait until `call` ended or `service` logged `line`; True for the line."""
    async with asyncio.timeout(30):
        while not call.done():
            if any(line in text for text in service.output):
                return True
            await asyncio.sleep(0.01)
    return False


async def test_a_killed_prefill_moves_its_jobs_but_not_its_manifests(
    services: tuple[Service, Service, Service, Service],
) -> None:
    doomed, steady, decode, solo = services
    await decode.wait_metric("hybrid_pd_prefill_peers_ready", lambda v: v == 2)
    tokens = await reference(decode)
    # One after the other, each held by decode between its manifest and its READ: the second goes
    # to the peer without a request of ours, so one manifest comes from each.
    late = []
    for i in range(2):
        late.append(asyncio.ensure_future(generate(decode.address, f"late-{i}", PROMPT, timeout=60)))
        await decode.wait_line(f"TEST PAUSE before_read late-{i}", timeout=30)
    late_on_a = {i for i in range(2) if jobs_logged(doomed, f"late-{i}", "OK")}
    assert len(late_on_a) == 1, doomed.tail()
    # Victims one at a time until one is held on peer-a before its manifest (those picked for
    # peer-b complete meanwhile; with one request of ours on each, the picks alternate).
    victims: list[asyncio.Future[Outcome]] = []
    for i in range(10):
        victims.append(asyncio.ensure_future(generate(decode.address, f"victim-{i}", PROMPT, timeout=60)))
        if await until_one_lands(doomed, f"TEST PAUSE before_manifest victim-{i}", victims[-1]):
            break
    assert not victims[-1].done(), "no victim was picked for peer-a"
    lone = asyncio.ensure_future(generate(solo.address, "victim-solo", PROMPT, timeout=60))
    await doomed.wait_line("TEST PAUSE before_manifest victim-solo", timeout=30)
    doomed.kill()

    for o in await asyncio.gather(*victims):  # the held one too, sent to peer-b once peer-a died
        assert served_by_b(o, tokens) and o.summary is not None and o.summary.state_verified, o
    for i, o in enumerate(await asyncio.gather(*late)):
        if i in late_on_a:  # its manifest had arrived: never sent elsewhere
            assert o.status == "UNAVAILABLE" and "peer-a" in o.message and "peer-b" not in o.message, o
        else:
            assert served_by_b(o, tokens), o
    alone = await lone  # control: nowhere else to go
    assert alone.status == "UNAVAILABLE" and "peer-a" in alone.message, alone
    assert (await decode.metrics())[RETRIES % "PEER_UNAVAILABLE"] == 1
    assert (await solo.metrics())[RETRIES % "PEER_UNAVAILABLE"] == 0

    await decode.wait_metric("hybrid_pd_prefill_peers_ready", lambda v: v == 1)
    after = await asyncio.gather(*(generate(decode.address, f"after-{i}", PROMPT) for i in range(4)))
    assert all(served_by_b(o, tokens) for o in after), after
    for service in (decode, solo, steady):
        await service.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    await steady.wait_metric("hybrid_pd_pinned_requests", lambda v: v == 0)
    await decode.wait_metric("hybrid_pd_remote_agents", lambda v: v == 1)  # peer-a's agent dropped
