"""TLS between the services with certificates made here (the openssl CLI): server-only TLS with a
private CA (--tls-cert/--tls-key/--tls-ca), and mutual TLS (--tls-client-ca), where a client
without a certificate is refused."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from tests.certificates import make_certificates

pytestmark = [
    pytest.mark.integration,
    pytest.mark.asyncio,
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, str]:
    """A CA and one certificate (signed by it) valid for 127.0.0.1, used by both services."""
    return make_certificates(tmp_path, "127.0.0.1", "IP:127.0.0.1,DNS:localhost")


async def test_mutual_tls_pair_and_refused_plain_client(start_prefill: Any, start_decode: Any, certs: dict[str, str]) -> None:
    tls = ["--tls-cert", certs["cert"], "--tls-key", certs["key"], "--tls-ca", certs["ca"], "--tls-client-ca", certs["ca"]]
    prefill = await start_prefill(*tls)
    decode = await start_decode(prefill.port, *tls)  # ready: its handshake went over mTLS
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(certs["ca"]).read_bytes(),
        private_key=Path(certs["key"]).read_bytes(),
        certificate_chain=Path(certs["cert"]).read_bytes(),
    )
    async with grpc.aio.secure_channel(f"127.0.0.1:{decode.port}", creds) as channel:
        tokens = []
        async for response in dpb_grpc.DecodeServiceStub(channel).Generate(
            dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=3), timeout=20
        ):
            tokens += response.chunk.token_ids
        assert len(tokens) == 3
    # TLS without a client certificate, and plaintext, are both refused.
    no_cert = grpc.ssl_channel_credentials(root_certificates=Path(certs["ca"]).read_bytes())
    for channel in (
        grpc.aio.secure_channel(f"127.0.0.1:{decode.port}", no_cert),
        grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}"),
    ):
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_generate_cli_without_client_certificate_is_refused(
    start_prefill: Any, start_decode: Any, certs: dict[str, str]
) -> None:
    tls = ["--tls-cert", certs["cert"], "--tls-key", certs["key"], "--tls-ca", certs["ca"], "--tls-client-ca", certs["ca"]]
    prefill = await start_prefill(*tls)
    decode = await start_decode(prefill.port, *tls)

    async def cli(*flags: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hybridpd_tools.cli.main", "generate", "--decode", f"127.0.0.1:{decode.port}",
            "--prompt-ids", "1,2,3", "--max-tokens", "2", "--timeout", "10", *flags,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode is not None
        return proc.returncode, err.decode()

    code, err = await cli("--tls-ca", certs["ca"])  # trusts the server, presents no certificate
    assert code == 1 and err.startswith("UNAVAILABLE"), err
    code, err = await cli()  # plaintext
    assert code == 1 and err.startswith("UNAVAILABLE"), err
    code, err = await cli("--tls-ca", certs["ca"], "--tls-cert", certs["cert"], "--tls-key", certs["key"])
    assert code == 0, err


async def generate_over(channel: grpc.aio.Channel) -> int:
    tokens = 0
    async for response in dpb_grpc.DecodeServiceStub(channel).Generate(
        dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=3), timeout=20
    ):
        tokens += len(response.chunk.token_ids)
    return tokens


async def test_server_only_tls_with_a_private_ca(start_prefill: Any, start_decode: Any, certs: dict[str, str]) -> None:
    """No --tls-client-ca: the servers ask for no client certificate, and clients that trust the
    private CA get through; one that trusts only the system roots, or speaks plaintext, does not."""
    tls = ["--tls-cert", certs["cert"], "--tls-key", certs["key"], "--tls-ca", certs["ca"]]
    prefill = await start_prefill(*tls)
    decode = await start_decode(prefill.port, *tls)  # ready: decode -> prefill went over TLS, checked by the CA
    trusts_ca = grpc.ssl_channel_credentials(root_certificates=Path(certs["ca"]).read_bytes())  # no client cert
    async with grpc.aio.secure_channel(f"127.0.0.1:{decode.port}", trusts_ca) as channel:
        assert await generate_over(channel) == 3
    for channel in (
        grpc.aio.secure_channel(f"127.0.0.1:{decode.port}", grpc.ssl_channel_credentials()),  # system roots only
        grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}"),
    ):
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
