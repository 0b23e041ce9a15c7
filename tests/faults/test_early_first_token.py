"""The first token ahead of the manifest (full-N boundary, hf engine), seen from a client.

Real processes, real NIXL, a tiny seeded checkpoint. Prefill draws output token 0 right after
the prompt's forward and sends it before its digests, pin and manifest; the TEST-ONLY hooks stop
a job right there (HYBRID_PD_TEST_PAUSE `before_manifest` holds it, HYBRID_PD_TEST_FAIL fails it),
which shows what the client gets and when:
- held before its manifest for longer than the client waits, the request has already streamed
  its first token (without the early token nothing could arrive before the hold ends); the client
  then goes away, and the job is cancelled on prefill with nothing left held;
- held likewise, a request whose first token ends it (max_tokens 1, or a stop token) is whole,
  summary included, while the manifest is still held: decode cancels the job instead of waiting;
- failed after its token left, the job goes to the other prefill engine, which draws the same
  token: the client gets every token exactly once, equal to an undisturbed run. Control: a decode
  engine that knows only the failing prefill fails the request, after its one early token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import grpc
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from tests.faults.harness import Outcome, Service, Spec, free_port, generate, start_many

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

HOLD_SECONDS = 60  # `held-` jobs wait this long before their manifest
CLIENT_WAIT_SECONDS = 30  # for the first chunk: well inside the hold, so it can only be the early token
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6, 5, 3)
RETRIES = "hybrid_pd_prefill_retries_total{reason=UNAVAILABLE}"
MAX_SENDS = 50  # `moved-` requests until one was picked for peer-a first (each takes 0.1 s or more)


@pytest.fixture(scope="module")
def services(hf_checkpoint: Callable[[str], str]) -> Iterator[tuple[Service, Service, Service, Service]]:
    model = ("--engine", "hf", "--model", hf_checkpoint("nemotron_h"), "--num-blocks", "64")
    # Short heartbeats: decode picks a prefill by the load it last reported (jobs of other decode engines included).
    prefill = (*model, "--heartbeat-seconds", "0.5")
    a, b = free_port(), free_port()
    started = start_many(
        Spec(
            "prefill",
            (*prefill, "--engine-id", "early-a", "--port", str(a)),
            pauses=f"before_manifest:{HOLD_SECONDS}:held-",
            env={"HYBRID_PD_TEST_FAIL": "UNAVAILABLE:moved-"},
        ),
        Spec("prefill", (*prefill, "--engine-id", "early-b", "--port", str(b))),
        Spec("decode", (*model, "--engine-id", "early-two", "--prefill", f"127.0.0.1:{a}", "--prefill", f"127.0.0.1:{b}")),
        Spec("decode", (*model, "--engine-id", "early-solo", "--prefill", f"127.0.0.1:{a}")),
    )
    try:
        yield started[0], started[1], started[2], started[3]
    finally:
        for service in started:
            service.kill()


async def reference(decode: Service) -> list[int]:
    ref = await generate(decode.address, "reference", PROMPT)
    assert ref.status == "OK" and len(ref.tokens) == 8, ref
    return ref.tokens


async def nothing_held(held: Service, solo: Service) -> None:
    for service in (held, solo):
        await service.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    assert (await held.metrics())["hybrid_pd_pinned_requests"] == 0


def jobs_logged(prefill: Service, prefix: str, status: str) -> int:
    return sum(f"job {prefix}" in line and f"finished: {status}" in line for line in prefill.output)


async def test_the_first_token_leaves_while_prefill_holds_its_manifest(
    services: tuple[Service, Service, Service, Service],
) -> None:
    held, _, _, solo = services
    await solo.wait_serving()
    tokens = await reference(solo)
    async with grpc.aio.insecure_channel(solo.address) as channel:
        request = dpb.GenerateRequest(request_id="held-1", prompt_token_ids=list(PROMPT), max_tokens=8)
        call = dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=2 * HOLD_SECONDS)
        first = await asyncio.wait_for(call.read(), CLIENT_WAIT_SECONDS)
        assert isinstance(first, dpb.GenerateResponse) and list(first.chunk.token_ids) == tokens[:1], first
        await held.wait_line("TEST PAUSE before_manifest held-1", timeout=CLIENT_WAIT_SECONDS)
        call.cancel()  # the client goes away while the job is still held before its manifest
    await held.wait_line("job held-1 finished: CANCELLED", timeout=10)
    await nothing_held(held, solo)


async def test_a_first_token_that_ends_the_request_needs_no_manifest(
    services: tuple[Service, Service, Service, Service],
) -> None:
    held, _, _, solo = services
    await solo.wait_serving()
    tokens = await reference(solo)
    cases = [
        ("held-one", dpb.GenerateRequest(max_tokens=1), dpb.FINISH_REASON_LENGTH),
        ("held-stop", dpb.GenerateRequest(max_tokens=8, stop_token_ids=tokens[:1]), dpb.FINISH_REASON_STOP),
    ]
    async with grpc.aio.insecure_channel(solo.address) as channel:
        for rid, request, reason in cases:
            request.MergeFrom(dpb.GenerateRequest(request_id=rid, prompt_token_ids=list(PROMPT)))
            # Within CLIENT_WAIT_SECONDS: the manifest is held for HOLD_SECONDS, so the summary came without it.
            replies = [r async for r in dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=CLIENT_WAIT_SECONDS)]
            chunks = [list(r.chunk.token_ids) for r in replies if r.HasField("chunk")]
            summaries = [r.summary for r in replies if r.HasField("summary")]
            assert chunks == [tokens[:1]] and len(summaries) == 1, (rid, replies)
            summary = summaries[0]
            assert (summary.finish_reason, summary.generated_token_count) == (reason, 1), (rid, summary)
            assert summary.prefill_engine_id == "early-a" and summary.transfer.read_count == 0, (rid, summary)
            assert not summary.prefix_state_reused and not summary.digests_verified, (rid, summary)
            engine_ns = summary.prefill_engine_duration.ToNanoseconds()  # as the early token said, with no manifest
            assert 0 < engine_ns < summary.prefill_duration.ToNanoseconds(), (rid, summary)
            await held.wait_line(f"job {rid} finished: CANCELLED", timeout=10)
    await nothing_held(held, solo)


async def test_a_job_failed_after_its_first_token_moves_and_the_token_is_sent_once(
    services: tuple[Service, Service, Service, Service],
) -> None:
    flaky, steady, decode, solo = services
    await decode.wait_serving()
    await decode.wait_metric("hybrid_pd_prefill_peers_ready", lambda v: v == 2)
    tokens = await reference(decode)
    # One at a time until one went to peer-a first (peer-a fails each of them, so it stays the less
    # loaded once its last report shows no other engine's job: within a heartbeat).
    outcomes: list[Outcome] = []
    for i in range(MAX_SENDS):
        outcomes.append(await generate(decode.address, f"moved-{i}", PROMPT))
        if (await decode.metrics())[RETRIES] >= 1:
            break
    for o in outcomes:
        assert o.status == "OK" and o.tokens == tokens, o
        assert o.summary is not None and o.summary.prefill_engine_id == "early-b" and o.summary.digests_verified, o
    retried = (await decode.metrics())[RETRIES]
    assert retried >= 1, flaky.tail()
    await flaky.wait_line(f"job moved-{len(outcomes) - 1} finished: UNAVAILABLE")
    assert jobs_logged(flaky, "moved-", "UNAVAILABLE") == retried

    # Control: with no other prefill the request fails as peer-a failed it, after its early token.
    alone = await generate(solo.address, "moved-solo", PROMPT)
    assert alone.status == "UNAVAILABLE" and "early-a" in alone.message and "TEST-ONLY" in alone.message, alone
    assert alone.tokens == tokens[:1], alone
    for service in (decode, solo, flaky, steady):
        await service.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
