"""An ASGI app served by uvicorn on the running event loop (the one gRPC uses).

uvicorn's `Server.serve()` normally owns the process's SIGINT/SIGTERM; here the service's
Lifecycle owns them (its drain also ends this server), so signal capture is switched off. The
socket is bound here, before uvicorn starts, so that port 0 yields the real port at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

# In-flight responses get this long once the service has drained (the drain itself already
# waited for the requests), then their connections are cut.
SHUTDOWN_GRACE_SECONDS = 1


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the service's Lifecycle handles signals


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(self, app: Any, host: str, port: int) -> None:
        self._sock = bind_socket(host, port)
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_config=None,  # keep the service's logging setup
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
            server_header=False,
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start failure
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.005)
        log.info("HTTP API on port %d", self.port)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        try:
            await self._task
        except SystemExit:  # uvicorn exits on a failed start; the failure is logged already
            pass
        finally:
            self._task = None
            self._sock.close()


def announce_http_port(port: int) -> None:
    """Printed before `LISTENING port=N`, so scripts that started with --http-port 0 find it."""
    print(f"HTTP port={port}", file=sys.stdout, flush=True)
