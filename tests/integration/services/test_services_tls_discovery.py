"""TLS with a discovered peer: decode resolves `--prefill localhost:PORT` to 127.0.0.1 and connects
to that address, but checks the prefill's certificate against the name. A certificate for the name
only (no IP in it) is accepted; a certificate for another name is refused (negative control)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.certificates import make_certificates

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio,
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

FLAGS = ["--host", "127.0.0.1", "--port", "0", "--num-blocks", "64", "--loop", "asyncio", "--engine", "synthetic"]


def make_certs(directory: Path, dns_name: str) -> list[str]:
    """TLS flags for a CA and one certificate whose only subjectAltName is DNS:`dns_name`."""
    c = make_certificates(directory, dns_name, f"DNS:{dns_name}")
    return ["--tls-cert", c["cert"], "--tls-key", c["key"], "--tls-ca", c["ca"], "--tls-client-ca", c["ca"]]


async def pair(tls: list[str]) -> tuple[PrefillApp, DecodeApp]:
    from shared.runtime.engine_host import engine_factory_for

    prefill = await PrefillApp.start(parse_settings("prefill", [*FLAGS, *tls], environ={}), engine_factory_for("synthetic"))
    settings = parse_settings("decode", [*FLAGS, *tls, "--prefill", f"localhost:{prefill.port}"], environ={})
    try:
        decode = await DecodeApp.start(settings, engine_factory_for("synthetic"))
    except BaseException:
        await prefill.stop()
        raise
    return prefill, decode


@pytest.mark.parametrize("name,accepted", [("localhost", True), ("other.test", False)])
async def test_discovered_address_is_checked_against_the_name(tmp_path: Path, name: str, accepted: bool) -> None:
    prefill, decode = await pair(make_certs(tmp_path, name))
    try:
        assert [p.target for p in decode.peers.peers] == [f"127.0.0.1:{prefill.port}"]  # the address, resolved
        if accepted:
            await decode.wait_ready(15)
        else:
            with pytest.raises(TimeoutError):
                await decode.wait_ready(3)
            status: Any = decode.peers.peers[0].status()
            assert status.state != dpb.PEER_STATE_READY and status.last_error, status
    finally:
        await asyncio.wait_for(decode.stop(), 30)
        await asyncio.wait_for(prefill.stop(), 30)
