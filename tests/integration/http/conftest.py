"""A real prefill + decode pair with the HTTP API on: grpc.aio and uvicorn on port 0, real NIXL
READs over UCX on DRAM, the tiny seeded reference model (tokens checked against a colocated run)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest_asyncio

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.engine.reference.colocated import colocated_generate
from shared.runtime.engine_host import engine_factory_for

MODEL = "tiny-mamba2"
COMMON = ["--model", MODEL, "--engine", "reference", "--num-blocks", "64", "--port", "0", "--http-port", "0",
          "--loop", "asyncio", "--log-level", "WARNING", "--heartbeat-seconds", "1.0"]  # fmt: skip


@dataclass
class HttpPair:
    prefill: PrefillApp
    decode: DecodeApp

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.decode.shell.http_port}"

    def expected_text(self, prompt: str | list[int], max_tokens: int) -> str:
        ids = list(prompt.encode()) if isinstance(prompt, str) else prompt
        out = colocated_generate(self.decode.host.spec, ids, max_tokens)
        return bytes(out).decode("utf-8", errors="replace")

    async def blocks_freed(self) -> None:
        async with asyncio.timeout(10):
            while self.prefill.host.allocator.num_used or self.decode.host.allocator.num_used:
                await asyncio.sleep(0.02)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(url: str, body: object | bytes | None = None, method: str | None = None, headers: dict[str, str] | None = None) -> Reply:
    """A plain HTTP call (blocking: run it in a thread); error statuses are returned, not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as reply:
            return Reply(reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


async def start_pair(*decode_flags: str, ready: bool = True) -> HttpPair:
    prefill = await PrefillApp.start(parse_settings("prefill", [*COMMON, "--engine-id", "http-prefill"], environ={}), engine_factory_for("reference"))
    settings = parse_settings(
        "decode", [*COMMON, "--engine-id", "http-decode", "--prefill", f"127.0.0.1:{prefill.port}", *decode_flags], environ={}
    )
    decode = await DecodeApp.start(settings, engine_factory_for("reference"))
    if ready:
        await decode.wait_ready(30)
        async with asyncio.timeout(10):  # health follows the peers through a callback
            while not decode.shell.health.ready:
                await asyncio.sleep(0.02)
    return HttpPair(prefill, decode)


async def stop_pair(pair: HttpPair) -> None:
    await asyncio.wait_for(pair.decode.stop(), 30)
    await asyncio.wait_for(pair.prefill.stop(), 30)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http_pair() -> AsyncIterator[HttpPair]:
    pair = await start_pair()
    try:
        yield pair
    finally:
        await stop_pair(pair)
