"""Readiness knows the data path: a prefill whose gRPC port answers but whose NIXL agent decode
cannot reach (here: the two processes share no UCX transport) never makes decode SERVING."""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.harness import Spec, free_port, generate, peer_status, start_many

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_unreachable_data_path_keeps_decode_not_serving() -> None:
    port = free_port()
    prefill, decode = start_many(
        Spec("prefill", ("--engine-id", "tcp-only-prefill", "--port", str(port)), env={"UCX_TLS": "tcp"}),
        Spec("decode", ("--engine-id", "shm-only-decode", "--prefill", f"127.0.0.1:{port}"), env={"UCX_TLS": "sm"}),
    )
    try:
        assert await prefill.health() == "SERVING"  # its own loopback READ works
        for _ in range(200):  # the handshake succeeds; adding the agent / the probe READ does not
            (peer,) = await peer_status(decode)
            if "agent" in peer.last_error:
                break
            await asyncio.sleep(0.05)
        assert "agent" in peer.last_error and "UNAVAILABLE" in peer.last_error, peer
        assert await decode.health() == "NOT_SERVING"
        assert await decode.health("") == "SERVING"
        outcome = await generate(decode.address, "nowhere-1")
        assert outcome.status == "UNAVAILABLE" and f"127.0.0.1:{port}" in outcome.message, outcome
        assert (await decode.metrics())["hybrid_pd_remote_agents"] == 0
    finally:
        prefill.kill()
        decode.kill()
