"""The two setups every `bench e2e` workload compares, started side by side.

- disaggregated: a prefill and a decode service (local subprocesses),
- colocated: colocated_server.py, the same engine prefilling and decoding in one process,

both behind DecodeService.Generate, so one client (client.py) measures both. `start_setups`
sizes every cache from the longest request it must hold and stops all three processes on exit.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from shared.bench.local_pair import LISTENING, LocalPair, start_pair
from shared.bench.sizing import blocks_needed, prefill_tokens
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout
from shared.layout.spec import ModelSpec

SETUPS = ("disaggregated", "colocated")


class Colocated:
    """The colocated_server process."""

    def __init__(self, args: Sequence[str], timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "shared.bench.colocated_server", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        output: list[str] = []
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("colocated server exited before listening:\n" + "".join(output[-20:]))
            output.append(line)
            match = LISTENING.search(line)
            if match:
                self.port = int(match.group(1))
                break
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"colocated server did not listen within {timeout:.0f} s")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout or ()], daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def model_spec(model: str, engine: str) -> ModelSpec:
    """The spec of a preset, or with the hf engine of a checkpoint directory."""
    if engine == "hf":
        from shared.engine.hf.model_spec import hf_model_spec

        return hf_model_spec(model)
    return load_model(model)


@dataclass(frozen=True)
class Running:
    """Both setups, up: Generate addresses and the serving processes' pids, per setup."""

    pair: LocalPair
    colocated: Colocated

    @property
    def addresses(self) -> dict[str, str]:
        return {"disaggregated": self.pair.decode.address, "colocated": self.colocated.address}

    @property
    def pids(self) -> dict[str, list[int]]:
        return {"disaggregated": [self.pair.prefill.proc.pid, self.pair.decode.proc.pid], "colocated": [self.colocated.proc.pid]}


@asynccontextmanager
async def start_setups(
    spec: ModelSpec,
    *,
    model: str,
    engine: str,
    prefill_tp: int,
    decode_tp: int,
    kernel_block_size: int,
    prompt_tokens: int,
    max_tokens: int,
    concurrent: int = 1,
    name: str = "bench-e2e",
    prefix_cache_blocks: int = 0,
) -> AsyncIterator[Running]:
    """Start both setups with caches for `concurrent` requests of up to `prompt_tokens` +
    `max_tokens` tokens each (one block spare), plus `prefix_cache_blocks` on the disaggregated
    decode for its prefix cache; stop them on exit."""
    prefill = build_engine_layout(spec, prefill_tp, kernel_block_size=kernel_block_size)
    decode = build_engine_layout(spec, decode_tp, kernel_block_size=kernel_block_size)
    p_blocks = concurrent * blocks_needed(prefill, prefill_tokens(spec, prompt_tokens)) + 1
    d_blocks = concurrent * blocks_needed(decode, prompt_tokens + max_tokens) + 1
    common = ["--model", model, "--engine", engine, "--kernel-block-size", str(kernel_block_size)]
    quiet = ["--log-level", "WARNING"]
    decode_own = ["--engine-id", f"{name}-decode", "--prefix-cache-blocks", str(prefix_cache_blocks)]
    pair = await start_pair(
        [*common, "--tp", str(prefill_tp), "--num-blocks", str(p_blocks), "--engine-id", f"{name}-prefill", *quiet],
        [*common, "--tp", str(decode_tp), "--num-blocks", str(d_blocks + prefix_cache_blocks), *decode_own, *quiet],
    )
    colocated: Colocated | None = None
    try:
        colocated = Colocated([*common, "--tp", str(decode_tp), "--num-blocks", str(d_blocks)])
        yield Running(pair, colocated)
    finally:
        if colocated is not None:
            colocated.stop()
        pair.stop()
