"""Run a prefill service and a decode service as local subprocesses (demo, benchmarks, fault tests).

Each service is started with `--port 0` and prints `LISTENING port=N` once it is bound; the pair
is ready when the decode service's health check says SERVING for its service name (which it
only does after its NIXL agents are up and a prefill peer is handshaken).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

LISTENING = re.compile(r"LISTENING port=(\d+)")
DECODE_SERVICE = "hybridpd.v1.DecodeService"
PREFILL_SERVICE = "hybridpd.v1.PrefillService"


class ServiceStartError(RuntimeError):
    pass


@dataclass
class ServiceProcess:
    role: str
    proc: subprocess.Popen[str]
    port: int
    output: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"  # where it listens (another host's address with a launch prefix)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float = 15.0) -> int:
        """SIGTERM (drain), then SIGKILL after `grace` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _drain(stream: IO[str], sink: list[str]) -> None:
    for line in stream:
        sink.append(line.rstrip("\n"))


def start_service(
    role: str,
    args: Sequence[str],
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    *,
    launch: Sequence[str] = (),
    host: str = "127.0.0.1",
) -> ServiceProcess:
    """Start `python -m {role}_svc --port 0 ARGS` and wait for its LISTENING line.

    `launch` runs it on another host (a command prefix, e.g. hybridpd_tools/bench/netns.py's
    Host.command([])), listening on that host's address `host`."""
    cmd = [*launch, sys.executable, "-m", f"{role}_svc", "--port", "0", *(["--host", host] if launch else []), *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    assert proc.stdout is not None
    output: list[str] = []
    deadline = time.monotonic() + timeout
    port = None
    while port is None:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            tail = "\n".join(output[-20:])
            raise ServiceStartError(f"{role} service exited with code {proc.returncode} before listening:\n{tail}")
        output.append(line.rstrip("\n"))
        match = LISTENING.search(line)
        if match:
            port = int(match.group(1))
        elif time.monotonic() > deadline:
            proc.kill()
            raise ServiceStartError(f"{role} service did not listen within {timeout:.0f} s")
    # Keep reading its output so the pipe never fills up and blocks the service.
    threading.Thread(target=_drain, args=(proc.stdout, output), daemon=True).start()
    return ServiceProcess(role, proc, port, output, host)


async def wait_serving(address: str, service: str, timeout: float = 60.0) -> None:
    """Poll the health service until `service` is SERVING."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                # The typed stubs leave the generated stub's methods out.
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)  # type: ignore[attr-defined]
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
            await asyncio.sleep(0.1)
    raise ServiceStartError(f"{service} at {address} not SERVING after {timeout:.0f} s (last: {last})")


@dataclass
class LocalPair:
    prefill: ServiceProcess
    decode: ServiceProcess

    def stop(self) -> tuple[int, int]:
        """Stop decode first (it holds reads against prefill), then prefill."""
        return self.decode.stop(), self.prefill.stop()


async def start_pair(
    prefill_args: Sequence[str],
    decode_args: Sequence[str],
    timeout: float = 90.0,
    *,
    prefill_launch: Sequence[str] = (),
    prefill_host: str = "127.0.0.1",
) -> LocalPair:
    """Prefill (on another host with `prefill_launch`, see start_service), then decode here."""
    prefill = start_service("prefill", prefill_args, timeout, launch=prefill_launch, host=prefill_host)
    try:
        decode = start_service("decode", [*decode_args, "--prefill", prefill.address], timeout)
    except BaseException:
        prefill.stop()
        raise
    pair = LocalPair(prefill, decode)
    try:
        await wait_serving(decode.address, DECODE_SERVICE, timeout)
    except BaseException:
        pair.stop()
        raise
    return pair
