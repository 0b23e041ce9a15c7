"""Real prefill and decode services in this process: grpc.aio servers on port 0, real NIXL
agents over UCX on DRAM, real caches; only the model engine is a stand-in (stamp_engine.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest_asyncio

from shared.config import parse_settings
from tests.integration.services import stamp_engine as stamp
from tests.reuse import REUSE_OFF

BASE_FLAGS = ["--host", "127.0.0.1", "--port", "0", "--num-blocks", "64", "--loop", "asyncio"]


def prefill_settings(*flags: str) -> Any:
    return parse_settings(
        "prefill", [*BASE_FLAGS, "--heartbeat-seconds", "1.0", "--engine-id", "test-prefill", *flags], environ={}
    )


def decode_settings(prefill_port: int, *flags: str) -> Any:
    return parse_settings(
        "decode",
        [*BASE_FLAGS, "--engine-id", "test-decode", "--prefill", f"127.0.0.1:{prefill_port}", *REUSE_OFF, *flags],
        environ={},
    )


@pytest_asyncio.fixture
async def start_prefill() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    from prefill_svc.app import PrefillApp

    apps: list[Any] = []

    async def start(*flags: str, engine: Any = None) -> Any:
        app = await PrefillApp.start(prefill_settings(*flags), engine or stamp.StampEngine)
        apps.append(app)
        return app

    yield start
    for app in apps:
        await app.stop()


@pytest_asyncio.fixture
async def start_decode() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    from decode_svc.app import DecodeApp

    apps: list[Any] = []

    async def start(prefill_port: int, *flags: str, ready: bool = True, engine: Any = None) -> Any:
        app = await DecodeApp.start(decode_settings(prefill_port, *flags), engine or stamp.StampEngine)
        apps.append(app)
        if ready:
            await app.wait_ready(10)
        return app

    yield start
    for app in apps:
        await app.stop()


@pytest_asyncio.fixture
async def channel_to() -> AsyncIterator[Callable[[int], grpc.aio.Channel]]:
    channels: list[grpc.aio.Channel] = []

    def open_channel(port: int) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return channel

    yield open_channel
    for channel in channels:
        await channel.close()
