"""Real services as subprocesses for fault tests: start, signal, watch their logs, read their
Prometheus metrics, and call Generate.

Every service runs with `--metrics-port 0` and prints `METRICS port=N` before `LISTENING port=N`;
block accounting (`hybrid_pd_blocks_in_use`), pins, sessions and open READ handles are read from
there, from outside the process, as an operator would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridpd_tools.bench.local_pair import DECODE_SERVICE, PREFILL_SERVICE, ServiceProcess, start_service
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from tests.decode_stream import settled
from tests.metric_samples import scrape
from tests.reuse import REUSE_OFF

METRICS = re.compile(r"METRICS port=(\d+)")
COMMON = ["--model", "tiny-mamba2", "--engine", "synthetic", "--loop", "uvloop", "--metrics-port", "0"]
SERVICE_NAMES = {"prefill": PREFILL_SERVICE, "decode": DECODE_SERVICE}


def free_port() -> int:
    """A port nobody listens on right now (a peer that is not there yet)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    role: str
    process: ServiceProcess
    metrics_port: int
    args: tuple[str, ...]
    env: dict[str, str]

    @property
    def address(self) -> str:
        return self.process.address

    @property
    def port(self) -> int:
        return self.process.port

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    @property
    def output(self) -> list[str]:
        return self.process.output

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output[-n:])

    def signal(self, sig: signal.Signals) -> None:
        if self.process.proc.poll() is None:
            self.process.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (works on a stopped process too) and reap it."""
        self.signal(signal.SIGKILL)
        self.process.proc.wait(10)

    def returncode(self, timeout: float) -> int:
        return self.process.proc.wait(timeout)

    def scrape(self) -> dict[str, float]:
        """Every sample, keyed `name` or `name{k=v,...}` (labels sorted)."""
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")

    async def metrics(self) -> dict[str, float]:
        return await asyncio.to_thread(self.scrape)

    async def blocks_in_use(self) -> int:
        return int((await self.metrics())["hybrid_pd_blocks_in_use"])

    async def wait_metric(self, name: str, check: Callable[[float], bool], timeout: float = 10.0) -> float:
        """Poll until `check(value)`; returns the value (fails with the last one seen)."""
        deadline = time.monotonic() + timeout
        value = float("nan")
        while time.monotonic() < deadline:
            value = (await self.metrics()).get(name, float("nan"))
            if check(value):
                return value
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.role}: {name} = {value} after {timeout} s\n{self.tail()}")

    async def wait_line(self, needle: str, timeout: float = 10.0, start: int = 0) -> int:
        """Index of the first output line from `start` on containing `needle`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(start, len(self.output)):
                if needle in self.output[i]:
                    return i
            await asyncio.sleep(0.005)
        raise AssertionError(f"{self.role}: no line with {needle!r} within {timeout} s\n{self.tail()}")

    async def health(self, service: str | None = None) -> str:
        name = SERVICE_NAMES[self.role] if service is None else service
        async with grpc.aio.insecure_channel(self.address) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
            except grpc.aio.AioRpcError as e:
                return str(e.code().name)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    async def wait_serving(self, timeout: float = 30.0) -> float:
        """Seconds until the readiness check says SERVING."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if await self.health() == "SERVING":
                return time.monotonic() - started
            await asyncio.sleep(0.05)
        raise AssertionError(f"{self.role} not SERVING after {timeout} s\n{self.tail()}")


def start(role: str, *args: str, pauses: str = "", env: dict[str, str] | None = None) -> Service:
    """`python -m {role}_svc` on port 0 (unless `--port` is in args) with metrics on port 0.

    `pauses` sets the TEST-ONLY HYBRID_PD_TEST_PAUSE hook (see shared/runtime/faults.py).
    """
    # The fault tests check how decode fails and recovers when its prefill engines fail; with
    # decode's fallback (--local-prefill, tested on its own) it would serve those requests itself.
    off = {"HYBRID_PD_LOCAL_PREFILL": "off"} if role == "decode" else {}
    full_env = {**off, **(env or {}), "HYBRID_PD_TEST_PAUSE": pauses}
    # The block accounting these tests read assumes decode keeps nothing after a request: its
    # prefix reuse (on by default) is off unless a test turns it on (a later flag wins).
    own = REUSE_OFF if role == "decode" else ()
    process = start_service(role, [*COMMON, *own, *args], timeout=60, env=full_env)
    for line in process.output:
        match = METRICS.search(line)
        if match:
            return Service(role, process, int(match.group(1)), tuple(args), full_env)
    process.proc.kill()
    raise AssertionError(f"{role}: no METRICS line\n" + "\n".join(process.output[-20:]))


async def start_async(role: str, *args: str, pauses: str = "", env: dict[str, str] | None = None) -> Service:
    return await asyncio.to_thread(start, role, *args, pauses=pauses, env=env)


@dataclass(frozen=True)
class Spec:
    role: str
    args: tuple[str, ...]
    pauses: str = ""
    env: dict[str, str] | None = None


def start_many(*specs: Spec) -> list[Service]:
    """Start several services at once (each takes seconds to import torch and NIXL); if one
    fails, the others are killed."""
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start, s.role, *s.args, pauses=s.pauses, env=s.env) for s in specs]
        concurrent.futures.wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(specs):
        for service in started:
            service.kill()
        raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore[misc]
    return started


@dataclass
class Outcome:
    status: str  # "OK" or a gRPC status name
    message: str
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0
    summary: dpb.GenerateSummary | None = None


async def generate(
    address: str,
    request_id: str,
    prompt: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8),
    max_tokens: int = 8,
    *,
    timeout: float = 30.0,
    channel: grpc.aio.Channel | None = None,
) -> Outcome:
    """One Generate call; never raises for a failed call (the outcome says how it ended)."""
    started = time.monotonic()
    request = dpb.GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt), max_tokens=max_tokens)
    got = await settled(channel or address, request, timeout=timeout)
    seconds, failure = time.monotonic() - started, got.failure
    if failure is not None:
        return Outcome(failure.status, failure.message, got.tokens, seconds)
    return Outcome("OK", "", got.tokens, seconds, got.summary)


async def peer_status(decode: Service) -> Any:
    async with grpc.aio.insecure_channel(decode.address) as channel:
        reply = await dpb_grpc.DecodeServiceStub(channel).GetLayout(dpb.GetLayoutRequest(), timeout=5)
    return list(reply.peers)
