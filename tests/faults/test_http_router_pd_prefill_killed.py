"""A prefill killed (SIGKILL) under the real vllm-router in P/D mode (`--vllm-pd-disaggregation
--kv-connector nixl`): 2 prefill and 2 decode processes, the decode engines without --prefill
(they learn each prefill engine from the requests' kv_transfer_params), 32 concurrent
openai-client requests. The decode engines hold every decode leg for a moment between its claim
and its READ (TEST-ONLY pause), and the victim is killed while it holds claimed requests, so the
kill lands on decode legs that claimed its blocks and on prefill legs it is still computing.

Each request either succeeds with the colocated run's text or fails cleanly: a decode leg with
our OpenAI error object (503, the lost session named), a prefill leg with the router's own 5xx
naming the prefill request that failed (both reach the client); never a hang or a
wrong answer. The decode engines forget the dead prefill engine they had learned; once the
router's health check has dropped it, every request succeeds on the survivor; every block is
freed on the surviving prefill and on both decode engines."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from tests.faults.harness import Service, Spec, peer_status, start_many
from tests.faults.router_requests import REFERENCE, expected, http_base, one
from tests.integration.http.test_http_vllm_router import needs_router, router, wait_routing
from tests.waiting import until

pytestmark = [pytest.mark.faults, pytest.mark.asyncio, pytest.mark.timeout(180)]

PREFILL = (*REFERENCE, "--heartbeat-seconds", "0.5", "--http-port", "0")  # decode judges silence by it
DECODE = (*REFERENCE, "--http-port", "0")  # no --prefill: P/D decode legs only
HOLD_BEFORE_READ = "before_read:3"  # TEST-ONLY: every decode leg waits 3 s between its claim and its READ
# The router checks every worker's /health each second and drops one at its first failure.
ROUTER_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1")


def clean_failure(error: openai.APIError, victim_http: str) -> str:
    """Which leg failed, for an error of one of the two clean forms (AssertionError otherwise)."""
    if isinstance(error, openai.APIStatusError):
        body = error.response.text
        if error.response.headers.get("content-type", "").startswith("application/json"):
            # The decode leg: our OpenAI error object, the lost prefill named.
            assert error.status_code == 503, body
            err = json.loads(body)["error"]
            assert err["code"] == "peer_unavailable" and "prefill" in err["message"], body
            return "decode leg"
        # The prefill leg: the router's own answer when the prefill it chose dropped the request.
        assert error.status_code >= 500 and f"Prefill request to {victim_http}" in body, body
        return "prefill leg"
    assert "prefill" in str(error), error  # an error event ending a stream that had started
    return "decode leg (streaming)"


def router_sees_unhealthy(base: str, url: str) -> bool:
    with urllib.request.urlopen(base + "/workers", timeout=5) as reply:
        workers = json.loads(reply.read())["workers"]
    return any(w["url"] == url and not w["is_healthy"] for w in workers)


async def learned(decodes: list[Service]) -> list[str]:
    return [p.target for d in decodes for p in await peer_status(d)]


@needs_router
async def test_prefill_killed_under_the_router_in_pd_mode() -> None:
    specs = [Spec("prefill", PREFILL), Spec("prefill", PREFILL)]
    specs += [Spec("decode", DECODE, pauses=HOLD_BEFORE_READ) for _ in range(2)]
    services = await asyncio.to_thread(start_many, *specs)
    prefills, decodes = services[:2], services[2:]
    victim, survivor = prefills
    victim_http = http_base(victim)
    try:
        for d in decodes:
            await d.wait_serving()
        args = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "round_robin", *ROUTER_HEALTH]
        args += [a for p in prefills for a in ("--prefill", http_base(p))]
        args += [a for d in decodes for a in ("--decode", http_base(d))]
        with router(*args) as base:
            await wait_routing(base)
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
                batch = [asyncio.ensure_future(one(client, i)) for i in range(32)]

                async def victim_holds_claimed_requests() -> bool:
                    m = await victim.metrics()
                    return m["hybrid_pd_pinned_requests"] - m["hybrid_pd_unclaimed_requests"] > 0

                await until(victim_holds_claimed_requests, "a decode leg claimed a request on the victim", timeout=30, every=0.05)
                assert victim.address in await learned(decodes)
                victim.kill()
                results = await asyncio.gather(*batch)

                # The decode engines forget the dead engine; the router stops choosing it.
                async def forgotten() -> bool:
                    return victim.address not in await learned(decodes)

                await until(forgotten, "the decode engines forget the dead prefill engine", timeout=30, every=0.05)
                await until(
                    lambda: asyncio.to_thread(router_sees_unhealthy, base, victim_http),
                    "the router drops it",
                    timeout=30,
                    every=0.05,
                )
                after = await asyncio.gather(*(one(client, 100 + i) for i in range(8)))

        for i, (how, answer) in enumerate(results):
            if how == "ok":
                assert answer == expected(i), i
        legs = [clean_failure(answer, victim_http) for how, answer in results if how == "failed"]
        assert any(leg.startswith("decode leg") for leg in legs), legs  # the claimed requests failed
        assert 0 < len(legs) < 32, legs
        assert after == [("ok", expected(100 + i)) for i in range(8)]
        # Every answer a client got OK was a decode engine's OK.
        ok = sum([(await d.metrics()).get("hybrid_pd_requests_total{status=OK}", 0) for d in decodes])
        assert ok == sum(how == "ok" for how, _ in [*results, *after])
        for alive in [survivor, *decodes]:
            await alive.wait_metric("hybrid_pd_blocks_in_use", lambda v: v == 0, timeout=20)
            await alive.wait_metric("hybrid_pd_open_read_handles", lambda v: v == 0, timeout=20)
        await survivor.wait_metric("hybrid_pd_pinned_requests", lambda v: v == 0, timeout=20)
        for d in decodes:  # the dead engine's NIXL agents were dropped with it
            await d.wait_metric("hybrid_pd_remote_agents", lambda v: v <= 1, timeout=20)
    finally:
        for service in [*decodes, *prefills]:
            service.kill()
