"""The prefill service of `bench control --separate-processes`, in a process of its own.

`python -m hybridpd_tools.bench.control_prefill PREFILL-SVC-FLAGS...` starts a real prefill service
(the flags of `prefill-svc`) with the engine that computes nothing (no_compute.py), prints one
JSON line `{"port": N}`, then answers commands on stdin, one JSON line each on stdout:

  end REQUEST_ID   when the pin of that request has ended: `{"request": ..., "reason": ...,
                   "ended_at": T}`, T the `time.perf_counter()` of the moment the pin ended
                   (CLOCK_MONOTONIC on Linux: the same clock in every process of the machine)
  used             `{"blocks_in_use": N}` (every rank's allocator together)

It drains and exits 0 when stdin closes. With the two services in separate processes neither
waits for the other's GIL, as in a deployment; the benchmark reads the moment prefill freed a
request's blocks from here instead of from the pin itself.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from hybridpd_tools.bench.no_compute import NoComputeEngine
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.errors import InvalidArgument, ServiceError
from shared.logs.setup import configure_logging
from shared.runtime.process import event_loop_factory


class PrefillProcess:
    """The benchmark's side: starts this module in a subprocess and speaks its stdin protocol."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self._proc = proc
        self.port = port

    @classmethod
    async def start(cls, flags: Sequence[str], timeout: float = 60.0) -> PrefillProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hybridpd_tools.bench.control_prefill",
            *flags,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            first = await asyncio.wait_for(cls._line(proc), timeout)
        except BaseException:
            await cls._end(proc)
            raise
        return cls(proc, int(first["port"]))

    async def pin_ended_at(self, request_id: str, timeout: float = 30.0) -> float:
        """The perf_counter moment prefill ended the request's pin (this machine's clock)."""
        answer = await self._ask(f"end {request_id}", timeout)
        if answer.get("reason") != "read":
            raise RuntimeError(f"prefill ended the pin of {request_id} for {answer.get('reason')!r}, not 'read'")
        return float(answer["ended_at"])

    async def blocks_in_use(self) -> int:
        return int((await self._ask("used", 10.0))["blocks_in_use"])

    async def stop(self) -> None:
        await self._end(self._proc)

    async def _ask(self, command: str, timeout: float) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(command.encode() + b"\n")
        await self._proc.stdin.drain()
        return await asyncio.wait_for(self._line(self._proc), timeout)

    @staticmethod
    async def _line(proc: asyncio.subprocess.Process) -> dict[str, Any]:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if not line:
            code = await proc.wait()
            raise RuntimeError(f"the benchmark's prefill process exited ({code}); its stderr says why")
        message: dict[str, Any] = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"the benchmark's prefill process: {message['error']}")
        return message

    @staticmethod
    async def _end(proc: asyncio.subprocess.Process) -> None:
        """Close stdin (it drains and exits); kill it if it does not within 30 s."""
        if proc.returncode is None and proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


class PinEnds:
    """Records when each pin ended, and lets a caller await that moment."""

    def __init__(self) -> None:
        self._ended: dict[str, tuple[float, str]] = {}
        self._waiting: dict[str, list[asyncio.Future[tuple[float, str]]]] = {}

    def ended(self, request_id: str, reason: str) -> None:
        moment = (time.perf_counter(), reason)
        self._ended[request_id] = moment
        for waiter in self._waiting.pop(request_id, []):
            if not waiter.done():
                waiter.set_result(moment)

    async def wait(self, request_id: str) -> tuple[float, str]:
        if request_id in self._ended:
            return self._ended.pop(request_id)
        waiter: asyncio.Future[tuple[float, str]] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(request_id, []).append(waiter)
        moment = await waiter
        self._ended.pop(request_id, None)
        return moment


def watch_pins(app: Any, ends: PinEnds) -> None:
    """Wrap the app's PinTable.pin so every pin reports its end to `ends`."""
    table = app.pins
    original = table.pin

    def pin(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        made.outcome.add_done_callback(lambda done, rid=made.request_id: ends.ended(rid, done.result()))
        return made

    table.pin = pin


async def serve(argv: Sequence[str]) -> None:
    app = await PrefillApp.start(parse_settings("prefill", argv), NoComputeEngine)
    ends = PinEnds()
    watch_pins(app, ends)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:  # a thread: stdin is a pipe, and blocking reads keep this simple
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line.strip())
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    _say({"port": app.port})
    try:
        while (line := await lines.get()) is not None:
            command, _, arg = line.partition(" ")
            if command == "end":
                ended_at, reason = await ends.wait(arg)
                _say({"request": arg, "reason": reason, "ended_at": ended_at})
            elif command == "used":
                _say({"blocks_in_use": int(app.host.allocator.num_used)})
            elif command:
                _say({"error": f"unknown command {command!r}"})
    finally:
        await app.stop()


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    settings = parse_settings("prefill", args)  # bad flags: usage and exit 2 before anything starts
    configure_logging(settings.log_level)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(settings.loop)) as runner:
            runner.run(serve(args))
    except ServiceError as e:  # as the services say it: one line, no traceback
        print(f"bench control prefill: {e.status}: {e.message}", file=sys.stderr)
        return 2 if isinstance(e, InvalidArgument) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
