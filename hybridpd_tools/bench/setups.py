"""The two setups every `bench e2e` workload compares, started side by side.

- disaggregated: a prefill and a decode service (local subprocesses),
- colocated: colocated_server.py, the same engine prefilling and decoding in one process,

both behind DecodeService.Generate, so one client (client.py) measures both. `start_setups`
sizes every cache from the longest request it must hold and stops all three processes on exit.

With `prefill_chunk_tokens` (pipelined transfer) the prefill and the colocated server prefill in
chunks of that size (the same compute, and with the hf engine the same bits), the decode
service takes manifest parts, and a third setup, `unpipelined`, is a second decode service on
the same prefill with --manifest-parts off: one manifest after the whole prompt, as before.
With `prefix_cache_states` another one, `states`, is a decode service on the same prefill with
decode's state checkpoints on (--prefix-cache-states, over the same --prefix-cache-blocks).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

from hybridpd_tools.bench.local_pair import (
    DECODE_SERVICE,
    LISTENING,
    LocalPair,
    ServiceProcess,
    start_pair,
    start_service,
    wait_serving,
)
from hybridpd_tools.bench.sizing import blocks_needed, prefill_tokens
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout
from shared.layout.spec import ModelSpec

SETUPS = ("disaggregated", "colocated")
PIPELINE_SETUPS = ("disaggregated", "unpipelined", "colocated")  # with prefill_chunk_tokens


@dataclass(frozen=True)
class SetupConfig:
    """What every setup of one run shares: the model and its engine, the TP sizes, the attention
    kernel block size, prefill's chunks (pipelined transfer), the boundary and the services'
    compute threads."""

    model: str
    engine: str
    prefill_tp: int = 1
    decode_tp: int = 1
    kernel_block_size: int = 16
    prefill_chunk_tokens: int = 0  # 0: prefill in one pass, one manifest
    manifest_part_tokens: int = 0  # prefill's --manifest-part-tokens (0: a part per chunk)
    layer_parts: int = 0  # prefill's --layer-parts (0: the last chunk in one part)
    boundary: str = ""  # "": the engine's default (full for hf and paged, n-1 for the others)
    # The services' --prefill-threads / --decode-threads (0: not passed, the service's default);
    # the colocated baseline keeps its one compute thread.
    prefill_threads: int = 0
    decode_threads: int = 0

    @property
    def resolved_boundary(self) -> str:
        """The boundary every setup runs: the one asked for, or the engine's default."""
        return self.boundary or ("full" if self.engine in ("hf", "paged") else "n-1")


class WorkloadConfig(Protocol):
    """A workload's config: a dataclass holding its setups' config and its own fields."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def setup(self) -> SetupConfig: ...


def flat_config(cfg: WorkloadConfig) -> dict[str, Any]:
    """A workload's config as one flat dict, as results record it: the setup's fields, then its own."""
    fields = asdict(cfg)
    return {**fields.pop("setup"), **fields}


class Colocated:
    """The colocated_server process."""

    def __init__(self, args: Sequence[str], timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "hybridpd_tools.bench.colocated_server", "--port", "0", *args]
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
    """The spec of a preset, or with the hf or paged engine of a checkpoint directory."""
    if engine in ("hf", "paged"):
        from shared.engine.hf.model_spec import hf_model_spec

        return hf_model_spec(model)
    return load_model(model)


@dataclass(frozen=True)
class Running:
    """Both setups, up: Generate addresses and the serving processes' pids, per setup."""

    pair: LocalPair
    colocated: Colocated
    unpipelined: ServiceProcess | None = None  # decode with --manifest-parts off, on the same prefill
    states: ServiceProcess | None = None  # decode with --prefix-cache-states, on the same prefill

    @property
    def addresses(self) -> dict[str, str]:
        more = {} if self.unpipelined is None else {"unpipelined": self.unpipelined.address}
        if self.states is not None:
            more["states"] = self.states.address
        return {"disaggregated": self.pair.decode.address, **more, "colocated": self.colocated.address}

    @property
    def pids(self) -> dict[str, list[int]]:
        more = {} if self.unpipelined is None else {"unpipelined": [self.pair.prefill.proc.pid, self.unpipelined.proc.pid]}
        return {
            "disaggregated": [self.pair.prefill.proc.pid, self.pair.decode.proc.pid],
            **more,
            "colocated": [self.colocated.proc.pid],
        }


@asynccontextmanager
async def start_setups(
    spec: ModelSpec,
    setup: SetupConfig,
    *,
    prompt_tokens: int,
    max_tokens: int,
    concurrent: int = 1,
    name: str = "bench-e2e",
    prefix_cache_blocks: int = 0,
    unpipelined: bool = True,
    prefix_cache_states: int = 0,
) -> AsyncIterator[Running]:
    """Start the setups of `setup` (`spec`: its model's) with caches for `concurrent` requests of up
    to `prompt_tokens` + `max_tokens` tokens each (one block spare), plus `prefix_cache_blocks` on
    the disaggregated decode for its prefix cache and on prefill for its boundary cache (used with
    chunked prefill on the paged engine); stop them on exit. With
    `setup.prefill_chunk_tokens`, `unpipelined` adds a decode service with --manifest-parts off on
    the same prefill (long-prompt's comparison); `prefix_cache_states` one with that many state
    checkpoints (repeat's comparison)."""
    model, engine, kernel_block_size = setup.model, setup.engine, setup.kernel_block_size
    prefill_tp, decode_tp, prefill_chunk_tokens = setup.prefill_tp, setup.decode_tp, setup.prefill_chunk_tokens
    prefill = build_engine_layout(spec, prefill_tp, kernel_block_size=kernel_block_size)
    decode = build_engine_layout(spec, decode_tp, kernel_block_size=kernel_block_size)
    p_blocks = concurrent * blocks_needed(prefill, prefill_tokens(spec, prompt_tokens)) + 1
    d_blocks = concurrent * blocks_needed(decode, prompt_tokens + max_tokens) + 1
    common = ["--model", model, "--engine", engine, "--kernel-block-size", str(kernel_block_size)]
    common += ["--boundary", setup.resolved_boundary]
    quiet = ["--log-level", "WARNING"]
    prefill_threads = ["--prefill-threads", str(setup.prefill_threads)] if setup.prefill_threads else []
    decode_threads = ["--decode-threads", str(setup.decode_threads)] if setup.decode_threads else []
    chunks = ["--prefill-chunk-tokens", str(prefill_chunk_tokens)] if prefill_chunk_tokens else []
    parts = (
        ["--manifest-part-tokens", str(setup.manifest_part_tokens)] if prefill_chunk_tokens and setup.manifest_part_tokens else []
    )
    parts += ["--layer-parts", str(setup.layer_parts)] if prefill_chunk_tokens and setup.layer_parts else []
    # The comparison decode (manifest parts off) runs without reuse, as the main one unless asked for.
    decode_args = [*common, "--tp", str(decode_tp), "--num-blocks", str(d_blocks), "--prefix-cache-blocks", "0"]
    decode_args += [*decode_threads, *quiet]
    cached = [*common, "--tp", str(decode_tp), "--num-blocks", str(d_blocks + prefix_cache_blocks), *decode_threads, *quiet]
    pair = await start_pair(
        [
            *common,
            "--tp",
            str(prefill_tp),
            "--num-blocks",
            str(p_blocks + prefix_cache_blocks),
            # Prefill's boundary cache (prefix reuse on prefill) gets as many blocks on top.
            "--prefix-cache-blocks",
            str(prefix_cache_blocks),
            "--engine-id",
            f"{name}-prefill",
            *chunks,
            *parts,
            *prefill_threads,
            *quiet,
        ],
        # State checkpoints only on the `states` decode below: this one measures what is READ.
        [
            *cached,
            "--engine-id",
            f"{name}-decode",
            "--prefix-cache-blocks",
            str(prefix_cache_blocks),
            "--prefix-cache-states",
            "0",
        ],
    )
    colocated: Colocated | None = None
    parts_off: ServiceProcess | None = None
    states: ServiceProcess | None = None
    try:
        if prefix_cache_states:
            states = start_service(
                "decode",
                [
                    *cached,
                    "--engine-id",
                    f"{name}-decode-states",
                    "--prefix-cache-blocks",
                    str(prefix_cache_blocks),
                    "--prefix-cache-states",
                    str(prefix_cache_states),
                    "--prefill",
                    pair.prefill.address,
                ],
            )
            await wait_serving(states.address, DECODE_SERVICE)
        if prefill_chunk_tokens and unpipelined:
            parts_off = start_service(
                "decode",
                [
                    *decode_args,
                    "--engine-id",
                    f"{name}-decode-unpipelined",
                    "--manifest-parts",
                    "off",
                    "--prefill",
                    pair.prefill.address,
                ],
            )
            await wait_serving(parts_off.address, DECODE_SERVICE)
        # No thread flags: the baseline is one process on one compute thread, the interference measured.
        colocated = Colocated([*common, "--tp", str(decode_tp), "--num-blocks", str(d_blocks), *chunks])
        yield Running(pair, colocated, parts_off, states)
    finally:
        if colocated is not None:
            colocated.stop()
        if states is not None:
            states.stop()
        if parts_off is not None:
            parts_off.stop()
        pair.stop()
