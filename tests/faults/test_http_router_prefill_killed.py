"""A prefill killed (SIGKILL) under the real vllm-router: 2 prefill and 2 decode processes, the
router in front of the decode engines' HTTP APIs, 32 concurrent openai-client requests. Each
request either succeeds with the colocated run's text (decode sends a job the dead prefill held
before its manifest to the other one; the router may retry one that failed) or
fails cleanly (an HTTP error or an
SSE error event, never a hang or a wrong answer); requests after the kill succeed on the
surviving prefill; every block is freed on every surviving process."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.faults.harness import Spec, start_many
from tests.faults.router_requests import REFERENCE, expected, http_base, one
from tests.integration.http.test_http_vllm_router import needs_router, router, wait_routing

pytestmark = [pytest.mark.faults, pytest.mark.asyncio, pytest.mark.timeout(240)]

PREFILL = (*REFERENCE, "--heartbeat-seconds", "0.5")  # decode uses the interval prefill announces


@needs_router
async def test_prefill_killed_under_the_router() -> None:
    # The victim holds every job for 5 s once computed (before its manifest), so the kill lands
    # while its requests are in flight; the survivor runs at full speed.
    prefills = await asyncio.to_thread(start_many, Spec("prefill", PREFILL, pauses="before_manifest:5"), Spec("prefill", PREFILL))
    peers = tuple(a for p in prefills for a in ("--prefill", p.address))
    decodes = await asyncio.to_thread(start_many, *(Spec("decode", (*REFERENCE, "--http-port", "0", *peers)) for _ in range(2)))
    try:
        for d in decodes:
            await d.wait_serving()
        with router("--worker-urls", *(http_base(d) for d in decodes), "--policy", "round_robin") as base:
            await wait_routing(base)
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
                batch = [asyncio.ensure_future(one(client, i)) for i in range(32)]
                await prefills[0].wait_line("TEST PAUSE before_manifest", timeout=30)
                prefills[0].kill()
                results = await asyncio.gather(*batch)
                after = await asyncio.gather(*(one(client, 100 + i) for i in range(8)))
        for i, (how, text) in enumerate(results):
            if how == "ok":
                assert text == expected(i), i
        assert sum(how == "ok" for how, _ in results) > 0
        # The kill hit jobs held before their manifest: decode sent them to the surviving prefill
        # (a request failed otherwise, the router, which retries 5xx answers, sent again); every
        # answer a client got OK was a decode's OK.
        counts = [await d.metrics() for d in decodes]
        retried = sum(m.get("hybrid_pd_prefill_retries_total{reason=PEER_UNAVAILABLE}", 0) for m in counts)
        ok = sum(m.get("hybrid_pd_requests_total{status=OK}", 0) for m in counts)
        assert retried > 0
        assert ok == sum(how == "ok" for how, _ in [*results, *after])
        assert [how for how, _ in after] == ["ok"] * 8, after
        for survivor in [prefills[1], *decodes]:
            await survivor.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0, timeout=20)
        await prefills[1].wait_metric("hybrid_pd_pinned_requests", lambda v: v == 0, timeout=20)
    finally:
        for service in [*decodes, *prefills]:
            service.kill()
