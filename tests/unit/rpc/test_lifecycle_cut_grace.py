"""The drain's last step after it cut requests at the end of their grace: the server stops with
FINAL_GRACE_SECONDS, not at once. A cut request's handler has ended with our UNAVAILABLE
(DRAIN_GRACE_ENDED), but its status may still be on its way to the client; a server stopped with
no grace cancels the call under it and the client reads gRPC's "Cancelling all calls" instead
(seen under load: tests/integration/services/test_services_status_accounting.py). That race
cannot be produced on demand with a real server, so the server here is a fake that records the
grace it is stopped with (the decision under test); the real path runs in that integration test."""

from __future__ import annotations

import asyncio

import pytest

from shared.rpc.health import HealthStatus
from shared.rpc.lifecycle import FINAL_GRACE_SECONDS, Lifecycle

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class RecordingServer:
    """Fake: records each stop's grace."""

    def __init__(self) -> None:
        self.graces: list[float | None] = []

    async def stop(self, grace: float | None) -> None:
        self.graces.append(grace)


async def _drain(lifecycle: Lifecycle, idle: asyncio.Event) -> RecordingServer:
    server = RecordingServer()
    await lifecycle.health.start()
    await lifecycle.drain(server, wait_idle=idle.wait)  # type: ignore[arg-type]
    return server


async def test_after_a_cut_the_server_stops_with_the_final_grace() -> None:
    lifecycle = Lifecycle(HealthStatus("test"), grace_seconds=0.05)
    cut: list[bool] = []

    async def request() -> None:
        with lifecycle.track():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cut.append(lifecycle.past_grace)
                raise

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0)
    server = await _drain(lifecycle, asyncio.Event())  # never idle: the grace runs out
    assert cut == [True] and task.cancelled()
    assert server.graces == [FINAL_GRACE_SECONDS]


async def test_an_idle_drain_stops_with_what_is_left_of_the_grace() -> None:
    lifecycle = Lifecycle(HealthStatus("test"), grace_seconds=0.5)
    idle = asyncio.Event()
    idle.set()
    server = await _drain(lifecycle, idle)
    (grace,) = server.graces
    assert grace is not None and 0.0 < grace <= min(0.5, FINAL_GRACE_SECONDS)
