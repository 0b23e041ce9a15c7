"""The real vllm-router (pip install vllm-router) in front of 2 prefill and 2 decode services.

Regular mode (`--worker-urls` = the decode engines, each of which picks its own prefill peer):
32 concurrent requests through the official openai client (completions and chat, streamed and
not) give the colocated run's text, both decode engines serve, and every block is freed.
P/D mode (`--vllm-pd-disaggregation --kv-connector nixl`, decode engines without --prefill):
the router sends each request's prefill leg to a prefill engine, which computes and pins the
state and answers kv_transfer_params, then the decode leg to a decode engine, which learns that
prefill engine from the params, claims and READs the state and generates; 32 concurrent
requests (completions and chat, streamed and not) give the colocated run's text, every engine
serves, and every block is freed. Skipped when vllm-router is not installed."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.engine.reference.colocated import colocated_generate
from shared.runtime.engine_host import engine_factory_for
from tests.integration.http.conftest import COMMON, MODEL
from tests.reuse import REUSE_OFF

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]


def router_binary() -> str | None:
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


ROUTER = router_binary()
needs_router = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(app: Any) -> str:
    return f"http://127.0.0.1:{app.shell.http_port}"


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[tuple[list[PrefillApp], list[DecodeApp]]]:
    factory = engine_factory_for("reference")
    prefills: list[PrefillApp] = []
    decodes: list[DecodeApp] = []
    try:
        for i in range(2):
            prefills.append(
                await PrefillApp.start(parse_settings("prefill", [*COMMON, "--engine-id", f"rp{i}"], environ={}), factory)
            )
        peers = [a for p in prefills for a in ("--prefill", f"127.0.0.1:{p.port}")]
        for i in range(2):
            decodes.append(
                await DecodeApp.start(
                    parse_settings("decode", [*COMMON, "--engine-id", f"rd{i}", *REUSE_OFF, *peers], environ={}), factory
                )
            )
        for d in decodes:
            await d.wait_ready(30)
        yield prefills, decodes
    finally:
        for app in [*decodes, *prefills]:
            await asyncio.wait_for(app.stop(), 30)


@contextlib.contextmanager
def router(*args: str) -> Iterator[str]:
    assert ROUTER is not None
    port = free_port()
    # The router re-checks a worker that was not healthy yet every 30 s by default: under load one
    # slow first /health then used up most of wait_routing's bound (seen once). Check every second.
    command = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-startup-check-interval", "1", *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def wait_routing(base: str) -> None:
    """Until the router answers (it first waits for every worker's /health)."""
    async with asyncio.timeout(90):
        while True:
            try:
                await asyncio.to_thread(urllib.request.urlopen, base + "/v1/models", None, 2)
                return
            except OSError:
                await asyncio.sleep(0.2)


def expected(decode: DecodeApp, prompt: str, n: int) -> str:
    return bytes(colocated_generate(decode.host.spec, list(prompt.encode()), n)).decode("utf-8", errors="replace")


def chat_prompt(text: str) -> str:
    return f"<|user|>\n{text}\n<|assistant|>\n"


async def all_free(apps: list[Any]) -> None:
    async with asyncio.timeout(15):
        while any(a.host.allocator.num_used for a in apps):
            await asyncio.sleep(0.05)


async def one(client: openai.AsyncOpenAI, i: int) -> str:
    text, kind = f"request {i}:", i % 4
    if kind == 0:
        out = await client.completions.create(model=MODEL, prompt=text, max_tokens=6)
        return out.choices[0].text
    if kind == 1:
        stream = await client.completions.create(model=MODEL, prompt=text, max_tokens=6, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])
    messages: Any = [{"role": "user", "content": text}]
    if kind == 2:
        chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        return chat.choices[0].message.content or ""
    stream_chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream_chat if c.choices])


@needs_router
async def test_router_in_front_of_decode_engines_serves_32_concurrent_requests() -> None:
    async with cluster() as (prefills, decodes):
        with router("--worker-urls", *(http(d) for d in decodes), "--policy", "round_robin") as base:
            await wait_routing(base)
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
                texts = await asyncio.gather(*(one(client, i) for i in range(32)))
        want = [expected(decodes[0], f"request {i}:" if i % 4 < 2 else chat_prompt(f"request {i}:"), 6) for i in range(32)]
        assert texts == want
        served = [d.metrics.registry.get_sample_value("hybrid_pd_requests_total", {"status": "OK"}) or 0 for d in decodes]
        assert sum(served) == 32 and all(s > 0 for s in served), served
        await all_free([*prefills, *decodes])


@contextlib.asynccontextmanager
async def pd_cluster() -> AsyncIterator[tuple[list[PrefillApp], list[DecodeApp]]]:
    """2 prefill + 2 decode engines; the decode engines have no --prefill (P/D decode legs only)."""
    factory = engine_factory_for("reference")
    apps: list[Any] = []
    try:
        prefills = [
            await PrefillApp.start(parse_settings("prefill", [*COMMON, "--engine-id", f"pp{i}"], environ={}), factory)
            for i in range(2)
        ]
        apps += prefills
        decodes = [
            await DecodeApp.start(parse_settings("decode", [*COMMON, "--engine-id", f"pd{i}", *REUSE_OFF], environ={}), factory)
            for i in range(2)
        ]
        apps += decodes
        yield prefills, decodes
    finally:
        for app in reversed(apps):
            await asyncio.wait_for(app.stop(), 30)


def served(app: Any, metric: str, labels: dict[str, str]) -> float:
    return float(app.metrics.registry.get_sample_value(metric, labels) or 0)


@needs_router
async def test_router_in_pd_mode_runs_both_legs_for_32_concurrent_requests() -> None:
    async with pd_cluster() as (prefills, decodes):
        args = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "round_robin"]
        args += [a for p in prefills for a in ("--prefill", http(p))]
        args += [a for d in decodes for a in ("--decode", http(d))]
        with router(*args) as base:
            await wait_routing(base)
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
                texts = await asyncio.gather(*(one(client, i) for i in range(32)))
        want = [expected(decodes[0], f"request {i}:" if i % 4 < 2 else chat_prompt(f"request {i}:"), 6) for i in range(32)]
        assert texts == want
        decoded = [served(d, "hybrid_pd_requests_total", {"status": "OK"}) for d in decodes]
        assert sum(decoded) == 32 and all(n > 0 for n in decoded), decoded
        # Every prefill leg's pin was claimed and ended by the READ notifications (none by lease).
        read = [p.pins.ended["read"] for p in prefills]
        assert sum(read) == 32 and all(n > 0 for n in read), read
        assert not any(p.pins.ended["lease_expired"] for p in prefills)
        await all_free([*prefills, *decodes])
        assert not any(len(p.pins) or len(p.servicer.handoffs) for p in prefills)
