"""Real services on namespace hosts (hybridpd_tools/bench/netns.py), driven from a client host.

`Cluster` owns a `Network`: `start(role, host, ...)` runs `python -m prefill_svc` /
`python -m decode_svc` on a host (listening on the host's address, port 0, metrics port 0,
`PYTHONPATH` = this checkout), and a driver process (tests/hosts/driver.py) on the last host makes
every gRPC call and metrics scrape from inside the network. UCX is pinned to TCP over the host's
eth0:

    UCX_TLS=tcp           only the TCP transport (no shm, no cma: they could not cross hosts anyway)
    UCX_NET_DEVICES=eth0  the host's link, never lo
    UCX_WARN_UNUSED_ENV_VARS=n  the services' UCX_MM_ERROR_HANDLING=y has no shm transport to apply to
    UCX_TCP_CM_REUSEADDR  unset; UCX picks ephemeral ports (docs/deploy.md says how to pin them)

Closing the cluster kills the driver, every service (their PID namespaces go with them) and the
namespaces, whatever state the test left them in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpd_tools.bench.netns import Host, Network
from tests.reuse import REUSE_OFF

CHECKOUT = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"LISTENING port=(\d+)")
METRICS = re.compile(r"METRICS port=(\d+)")
SERVICE_NAMES = {"prefill": "hybridpd.v1.PrefillService", "decode": "hybridpd.v1.DecodeService"}
# Every host has a network namespace of its own, so fixed ports never collide (as on real
# machines): a decode can be started with its prefill's address before that prefill listens.
PORTS = {"prefill": 50051, "decode": 50052}
METRICS_PORT = 9400
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def host_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "HYBRID_PD_"))}
    return {**env, "PYTHONPATH": str(CHECKOUT), "PYTHONUNBUFFERED": "1", **UCX_ENV, **(extra or {})}


def _pump(stream: Any, sink: list[str], on_line: Callable[[str], None] | None = None) -> None:
    for line in stream:
        sink.append(line.rstrip("\n"))
        if on_line is not None:
            on_line(line)


@dataclass
class HostService:
    role: str
    host: Host
    proc: subprocess.Popen[str]
    port: int
    metrics_port: int
    output: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host.address}:{self.metrics_port}/metrics"

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.output[-n:])


class Driver:
    """The driver process on the client host; methods are awaitable from any event loop."""

    def __init__(self, network: Network, host: Host) -> None:
        self.host = host
        self.proc = network.spawn(
            host,
            [sys.executable, "-m", "tests.hosts.driver"],
            host_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=1,
        )
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.errors: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        ready = self.proc.stdout.readline()
        if "DRIVER ready" not in ready:
            raise RuntimeError(f"driver did not start: {ready!r} {self.proc.stderr.read()}")
        threading.Thread(target=self._replies, daemon=True).start()
        threading.Thread(target=_pump, args=(self.proc.stderr, self.errors), daemon=True).start()

    def _replies(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self._lock:
                future = self._pending.pop(reply["id"])
            future.set_result(reply)
        with self._lock:
            for future in self._pending.values():
                future.set_exception(RuntimeError("driver exited:\n" + "\n".join(self.errors[-20:])))

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._lock:
            n = next(self._ids)
            self._pending[n] = future
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": n, "op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = await asyncio.wrap_future(future)
        if "error" in reply:
            raise RuntimeError(f"driver {op}: {reply['error']}")
        return reply

    async def generate(
        self, decode: HostService, request_id: str, prompt: Sequence[int], max_tokens: int, timeout: float = 60.0
    ) -> dict[str, Any]:
        return await self.call(
            "generate", target=decode.address, request_id=request_id, prompt=list(prompt), max_tokens=max_tokens, timeout=timeout
        )

    async def metrics(self, service: HostService) -> dict[str, float]:
        return (await self.call("metrics", url=service.metrics_url))["samples"]  # type: ignore[no-any-return]

    async def health(self, service: HostService, name: str | None = None) -> str:
        reply = await self.call("health", target=service.address, service=SERVICE_NAMES[service.role] if name is None else name)
        return str(reply["status"])

    async def peers(self, decode: HostService) -> list[dict[str, Any]]:
        return (await self.call("peers", target=decode.address))["peers"]  # type: ignore[no-any-return]

    async def wait_serving(self, service: HostService, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        status = "?"
        while time.monotonic() < deadline:
            status = await self.health(service)
            if status == "SERVING":
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{service.role} on {service.host.name} {status} after {timeout} s\n{service.tail()}")

    async def wait_metric(self, service: HostService, name: str, check: Callable[[float], bool], timeout: float = 20.0) -> float:
        deadline = time.monotonic() + timeout
        value = float("nan")
        while time.monotonic() < deadline:
            value = (await self.metrics(service)).get(name, float("nan"))
            if check(value):
                return value
            await asyncio.sleep(0.1)
        raise AssertionError(f"{service.role} on {service.host.name}: {name} = {value} after {timeout} s\n{service.tail()}")


class Cluster:
    """`hosts` service hosts plus one client host (the last) running the driver."""

    def __init__(self, hosts: int) -> None:
        self.network = Network.create(hosts + 1)
        try:
            self.client = self.network.hosts[-1]
            self.hosts = self.network.hosts[:-1]
            self.driver = Driver(self.network, self.client)
        except BaseException:
            self.network.close()
            raise

    @staticmethod
    def address(role: str, host: Host) -> str:
        """Where a service started on `host` listens."""
        return f"{host.address}:{PORTS[role]}"

    def start(
        self,
        role: str,
        host: Host,
        *args: str,
        env: dict[str, str] | None = None,
        timeout: float = 90.0,
        resolv_conf: str | None = None,
    ) -> HostService:
        """Start a service on `host` and wait for its LISTENING line (metrics come first);
        `resolv_conf` gives it a resolver of its own (tests/hosts/dns.py)."""
        argv = [
            sys.executable,
            "-m",
            f"{role}_svc",
            "--host",
            host.address,
            "--port",
            str(PORTS[role]),
            "--metrics-port",
            str(METRICS_PORT),
            "--engine-id",
            f"{role}-{host.name}",
            "--log-level",
            "WARNING",
            *(REUSE_OFF if role == "decode" else ()),  # the tests check decode frees every block
            *args,
        ]
        proc = self.network.spawn(
            host, argv, host_env(env), resolv_conf=resolv_conf, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert proc.stdout is not None
        output: list[str] = []
        found: dict[str, int] = {}
        listening = threading.Event()

        def on_line(line: str) -> None:
            for key, pattern in (("metrics", METRICS), ("port", LISTENING)):
                match = pattern.search(line)
                if match:
                    found[key] = int(match.group(1))
            if "port" in found:
                listening.set()

        pump = threading.Thread(target=_pump, args=(proc.stdout, output, on_line), daemon=True)
        pump.start()
        deadline = time.monotonic() + timeout
        while not listening.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pump.join(5)
                raise AssertionError(f"{role} on {host.name} did not listen (rc {proc.poll()}):\n" + "\n".join(output[-30:]))
        return HostService(role, host, proc, found["port"], found["metrics"], output)

    def start_many(
        self, *specs: tuple[str, Host, Sequence[str]] | tuple[str, Host, Sequence[str], dict[str, str]]
    ) -> list[HostService]:
        """Start several services at once (each spends seconds importing torch and NIXL);
        a spec is (role, host, args) or (role, host, args, env)."""
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
            futures = [pool.submit(self.start, s[0], s[1], *s[2], env=s[3] if len(s) == 4 else None) for s in specs]
            return [f.result() for f in futures]

    def close(self) -> None:
        self.network.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Connection:
    local_port: int
    remote_port: int
    bytes_received: int


def data_plane_connections(host: Host, peer: Host) -> list[Connection]:
    """Established TCP connections of `host` with `peer` that are not gRPC or metrics (the
    services' ports): the UCX data plane, with the kernel's own byte counts (`ss -ti`)."""
    service_ports = set(PORTS.values()) | {METRICS_PORT}
    found: list[Connection] = []
    lines = host.run("ss", "-tinH", "state", "established").splitlines()
    for i, line in enumerate(lines):
        fields = line.split()
        if len(fields) < 4 or not fields[0].isdigit():
            continue  # an info line
        local, remote = fields[2], fields[3]
        remote_host, remote_port = remote.rsplit(":", 1)
        local_port = int(local.rsplit(":", 1)[1])
        if not remote_host.endswith(peer.address) or {local_port, int(remote_port)} & service_ports:
            continue
        info = lines[i + 1] if i + 1 < len(lines) else ""
        match = re.search(r"bytes_received:(\d+)", info)
        found.append(Connection(local_port, int(remote_port), int(match.group(1)) if match else 0))
    return found


def data_plane_bytes_received(host: Host, peer: Host) -> int:
    """Bytes `host` received from `peer` over the UCX data plane."""
    return sum(c.bytes_received for c in data_plane_connections(host, peer))


def qdisc_bytes_sent(host: Host) -> int:
    """Bytes the root qdisc of the host's eth0 sent (`tc -s`): what went through a shaper."""
    match = re.search(r"Sent (\d+) bytes", host.run("tc", "-s", "qdisc", "show", "dev", host.interface))
    return int(match.group(1)) if match else 0
