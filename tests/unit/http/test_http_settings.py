"""--http-port / HYBRID_PD_HTTP_PORT, and the embedded server binding port 0 and stopping."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from shared.config import parse_settings
from shared.http.server import HttpServer

BASE = ["--prefill", "127.0.0.1:1"]


def test_http_port_from_flag_env_or_off() -> None:
    assert parse_settings("decode", BASE, environ={}).http_port is None
    assert parse_settings("decode", BASE, environ={"HYBRID_PD_HTTP_PORT": "0"}).http_port == 0
    assert parse_settings("prefill", ["--http-port", "8000"], environ={"HYBRID_PD_HTTP_PORT": "9000"}).http_port == 8000


def test_bad_http_port_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings("decode", BASE, environ={"HYBRID_PD_HTTP_PORT": "70000"})
    assert info.value.code == 2
    assert "--http-port (from HYBRID_PD_HTTP_PORT)" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_server_binds_port_zero_serves_and_stops() -> None:
    async def hello(request: object) -> PlainTextResponse:
        return PlainTextResponse("hi")

    server = HttpServer(Starlette(routes=[Route("/", hello)]), "127.0.0.1", 0)
    assert server.port > 0
    await server.start()
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=5).read())
    assert body == b"hi"
    await server.stop()
    with pytest.raises(OSError):
        await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{server.port}/", None, 2)


def test_a_taken_http_port_fails_the_start_before_grpc_listens() -> None:
    import socket

    from shared.rpc.service import ServiceShell

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        settings = parse_settings("prefill", ["--port", "0", "--http-port", str(taken.getsockname()[1])], environ={})

        shells: list[ServiceShell] = []

        async def start() -> None:
            shell = ServiceShell("x.Service", settings)
            shell.http_app = Starlette()
            shells.append(shell)
            await shell.start()

        with pytest.raises(OSError):
            asyncio.run(start())
    assert shells[0].port == 0  # gRPC never listened
