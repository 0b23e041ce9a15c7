"""TLS with a discovered peer: decode resolves `--prefill localhost:PORT` to 127.0.0.1 and connects
to that address, but checks the prefill's certificate against the name. A certificate for the name
only (no IP in it) is accepted; a certificate for another name is refused (negative control)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio,
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

FLAGS = ["--host", "127.0.0.1", "--port", "0", "--num-blocks", "64", "--loop", "asyncio", "--engine", "synthetic"]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_certs(directory: Path, dns_name: str) -> list[str]:
    """TLS flags for a CA and one certificate whose only subjectAltName is DNS:`dns_name`."""
    ca_key, ca, key, csr, cert = (str(directory / n) for n in ("ca.key", "ca.pem", "svc.key", "svc.csr", "svc.pem"))
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={dns_name}")
    ext = directory / "ext.cnf"
    ext.write_text(f"subjectAltName=DNS:{dns_name}\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-out",
        cert,
        "-days",
        "1",
        "-extfile",
        str(ext),
    )
    return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca, "--tls-client-ca", ca]


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
