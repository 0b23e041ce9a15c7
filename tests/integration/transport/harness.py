"""Two-process harness: a target rank in a subprocess, an initiator rank in the test process."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from shared.cache.memory_place import MemoryPlace
from shared.cache.regions import RankCache
from shared.transport.agent import PreppedList, RankAgent
from shared.transport.poller import CompletionPoller
from tests.integration.transport import nixl_target as target_script

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
TARGET_SCRIPT = HERE / "nixl_target.py"


def all_block_descs(bases: npt.ArrayLike, num_blocks: int, page_bytes: int) -> npt.NDArray[np.int64]:
    """Nx2 (address, length) of every block of every region; id = region * num_blocks + block."""
    starts = np.asarray(bases, dtype=np.int64)[:, None] + np.arange(num_blocks, dtype=np.int64) * page_bytes
    return np.stack([starts.ravel(), np.full(starts.size, page_bytes, dtype=np.int64)], axis=1)


def expected_cache(seed: int, num_blocks: int, page_bytes: int) -> RankCache:
    """What a target started with `seed` holds, computed here rather than read from it."""
    cache = RankCache(1, num_blocks, page_bytes)
    target_script.fill_pattern(cache, seed)
    return cache


@dataclass
class Target:
    """A target rank process and the JSON lines it printed."""

    proc: subprocess.Popen[str]
    lines: queue.Queue[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False

    @staticmethod
    async def spawn(**options: Any) -> Target:
        argv = [sys.executable, str(TARGET_SCRIPT)]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=path),
            cwd=REPO_ROOT,
        )
        lines: queue.Queue[dict[str, Any]] = queue.Queue()

        def pump_stdout() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(json.loads(line))

        threading.Thread(target=pump_stdout, daemon=True).start()
        target = Target(proc, lines)
        try:
            target.info = await target.next_line(timeout=30)
        except BaseException:
            target.kill()
            raise
        return target

    @property
    def name(self) -> str:
        return str(self.info["name"])

    @property
    def metadata(self) -> bytes:
        return bytes.fromhex(self.info["metadata"])

    @property
    def place(self) -> MemoryPlace:
        return MemoryPlace(self.info["mem_type"], int(self.info["device_id"]))

    def descs(self, num_blocks: int, page_bytes: int) -> npt.NDArray[np.int64]:
        return all_block_descs(self.info["bases"], num_blocks, page_bytes)

    async def next_line(self, timeout: float = 5.0) -> dict[str, Any]:
        line: dict[str, Any] = await asyncio.to_thread(self.lines.get, True, timeout)
        return line

    async def expect(self, key: str, count: int = 1) -> None:
        """Make the target wait for `count` notifications `key`; returns once it waits."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"expect {key} {count}\n")
        self.proc.stdin.flush()
        line = await self.next_line()
        assert line == {"expecting": key}, line

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)
        self.stopped = sig == signal.SIGSTOP

    def kill(self) -> None:
        if self.proc.poll() is None:
            if self.stopped:
                self.signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


@dataclass
class Initiator:
    """The reading rank in the test process."""

    agent: RankAgent
    cache: RankCache
    poller: CompletionPoller

    @staticmethod
    async def make(num_blocks: int, page_bytes: int) -> Initiator:
        agent = await RankAgent.create("initiator", 0)
        cache = RankCache(1, num_blocks, page_bytes)
        await cache.register(agent)
        return Initiator(agent, cache, CompletionPoller())

    async def connect(self, target: Target) -> tuple[str, PreppedList, PreppedList]:
        """Add the target and prepare both sides' lists of all blocks (same geometry)."""
        name = await self.agent.add_remote(target.metadata)
        local = await self.agent.prep_local(
            all_block_descs(self.cache.base_addresses(), self.cache.num_blocks, self.cache.page_bytes)
        )
        remote = await self.agent.prep_remote(name, target.descs(self.cache.num_blocks, self.cache.page_bytes), target.place)
        return name, local, remote

    async def close(self) -> None:
        await self.poller.aclose()
        await self.agent.aclose()
