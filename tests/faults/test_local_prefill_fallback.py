"""Decode's fallback (--local-prefill fallback) when its only prefill engine is killed (SIGKILL of a
real subprocess) with a batch of jobs in flight: the requests whose jobs died fail UNAVAILABLE
naming the prefill, decode frees every block, READ handle and remote agent, stays SERVING, and
computes the next requests itself (prefilled_locally, counted per reason) until a prefill is back.
On the paged engine (a tiny checkpoint) the jobs were computed in batched prefill steps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.faults.harness import Service, free_port, generate, start_async

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

BATCH = 4


@pytest.mark.parametrize("engine", ["synthetic", "paged"])
async def test_prefill_killed_with_jobs_in_flight_then_decode_computes_the_next_requests(
    engine: str, hf_checkpoint: Callable[[str], str]
) -> None:
    model = ("--engine", engine) if engine == "synthetic" else ("--engine", engine, "--model", hf_checkpoint("nemotron_h"))
    port = free_port()
    started: list[Service] = []
    try:
        prefill = await start_async(
            "prefill", *model, "--engine-id", "fallback-prefill", "--num-blocks", "64", "--heartbeat-seconds", "0.5",
            "--port", str(port), pauses="before_manifest:30:batch-",
        )  # fmt: skip
        started.append(prefill)
        decode = await start_async(
            "decode", *model, "--engine-id", "fallback-decode", "--num-blocks", "64", "--check-state",
            "--prefill", f"127.0.0.1:{port}", env={"HYBRID_PD_LOCAL_PREFILL": "fallback"},
        )  # fmt: skip
        started.append(decode)
        await decode.wait_serving()  # through its prefill peer
        ok = await generate(decode.address, "through-prefill")
        assert ok.status == "OK" and ok.summary is not None and not ok.summary.prefilled_locally, ok
        calls = [asyncio.ensure_future(generate(decode.address, f"batch-{i}")) for i in range(BATCH)]
        for i in range(BATCH):  # every job of the batch is held on prefill before its manifest
            await prefill.wait_line(f"TEST PAUSE before_manifest batch-{i}")
        if engine == "paged":  # computed in prefill steps: one chunk per job, steps shared as they arrived
            assert (await prefill.metrics())["hybrid_pd_prefill_batch_size_sum"] == 1 + BATCH
        prefill.kill()
        outcomes = await asyncio.gather(*calls)
        for o in outcomes:
            assert o.status == "UNAVAILABLE" and "fallback-prefill" in o.message, o
        await decode.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
        await decode.wait_metric("hybrid_pd_open_read_handles", lambda v: v == 0)
        await decode.wait_metric("hybrid_pd_requests_in_flight", lambda v: v == 0)
        await decode.wait_metric("hybrid_pd_remote_agents", lambda v: v == 0)
        assert await decode.health() == "SERVING"  # a slowdown, not an outage
        after = await asyncio.gather(*(generate(decode.address, f"after-{i}") for i in range(BATCH)))
        for o in after:
            assert o.status == "OK" and o.summary is not None, o
            assert o.summary.prefilled_locally and o.summary.state_verified is False, o
            assert o.tokens == ok.tokens  # the same prompt: the same tokens computed here
        metrics = await decode.metrics()
        assert metrics["hybrid_pd_local_prefills_total{reason=no_prefill_ready}"] == BATCH
        await decode.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0)
    finally:
        for service in started:
            service.kill()
