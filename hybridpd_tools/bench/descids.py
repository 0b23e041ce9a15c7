"""Micro-benchmark of per-request descriptor ids: `read_indices` for a request of B blocks.

"Blocks" are the request's attention kernel blocks (the unit vLLM and NIXL users count;
16 tokens by default), in every FA group; each Mamba group has its one block. The read lists
are built once (as the decode service does per peer) and not timed. Both wall time and CPU
time of the calling thread are reported: on a shared machine the CPU time shows the cost
without the time other processes held the core.

The ids are written into arrays from an IdBufferPool, taken and given back per call as the
decode service does per READ (arrays reused across requests). Interleaved with those calls,
the same call into fresh arrays (`fresh_*`): what the first request of a new size pays, most
of it page faults of the new arrays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hybridpd_tools.bench.pairs import fake_bases, pair_lists
from hybridpd_tools.bench.progress import Progress
from hybridpd_tools.bench.sizing import blocks_needed, request_blocks
from hybridpd_tools.bench.stats import Summary, json_number
from shared.cache.id_buffers import IdBufferPool
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout
from shared.layout.plan import build_plan
from shared.layout.read_lists import read_indices

SCHEMA = "hybrid-pd.bench.descids/v1"
TARGET_MS = 5.0


@dataclass(frozen=True)
class DescIdsConfig:
    model: str = "nemotron-3-nano-30b-a3b"
    blocks: int = 100_000
    prefill_tp: int = 1
    decode_tp: int = 1
    kernel_block_size: int = 16
    repeat: int = 30


def run_descids(cfg: DescIdsConfig, *, command: str, show_progress: bool = True) -> dict[str, Any]:
    spec = load_model(cfg.model)
    prefill = build_engine_layout(spec, cfg.prefill_tp, kernel_block_size=cfg.kernel_block_size)
    decode = build_engine_layout(spec, cfg.decode_tp, kernel_block_size=cfg.kernel_block_size)
    plan = build_plan(prefill, decode)
    tokens = cfg.blocks * cfg.kernel_block_size  # transferred tokens filling exactly `blocks` kernel blocks
    p_blocks, d_blocks = blocks_needed(prefill, tokens), blocks_needed(decode, tokens)
    pairs = pair_lists(
        plan,
        local_bases=fake_bases(decode.tp, decode.num_regions, decode.region_bytes(d_blocks), side=1),
        remote_bases=fake_bases(prefill.tp, prefill.num_regions, prefill.region_bytes(p_blocks), side=2),
        local_num_blocks=d_blocks,
        remote_num_blocks=p_blocks,
    )
    pair = pairs[0]  # one (decode rank, prefill rank) pair: what one READ needs
    local, remote = request_blocks(decode, tokens), request_blocks(prefill, tokens)
    pool = IdBufferPool()
    wall: list[float] = []
    cpu: list[float] = []
    fresh_wall: list[float] = []
    ids = 0
    with Progress("bench descids", cfg.repeat + 1, enabled=show_progress) as progress:  # drawn at once: the sweep began
        for _ in range(cfg.repeat + 1):  # the first call fills the pool and is dropped
            claim = pool.claim()
            w0, c0 = time.perf_counter(), time.thread_time()
            lidx, _ = read_indices(pair.lists, local, remote, tokens, buffers=claim)
            w1, c1 = time.perf_counter(), time.thread_time()
            ids = int(lidx.size)
            del lidx
            claim.release()  # the READ was posted: NIXL holds its own copy of the ids
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
            f0 = time.perf_counter()
            fresh, _ = read_indices(pair.lists, local, remote, tokens)
            fresh_wall.append(time.perf_counter() - f0)
            del fresh
            progress.advance()
    wall, cpu, fresh_wall = wall[1:], cpu[1:], fresh_wall[1:]
    w, c = Summary.of(wall).scaled(1e3), Summary.of(cpu).scaled(1e3)
    return {
        "schema": SCHEMA,
        "command": command,
        "config": {
            "model": cfg.model,
            "blocks": cfg.blocks,
            "tokens": tokens,
            "prefill_tp": cfg.prefill_tp,
            "decode_tp": cfg.decode_tp,
            "kernel_block_size": cfg.kernel_block_size,
            "repeat": cfg.repeat,
            "pair": [pair.decode_rank, pair.prefill_rank],
        },
        "ids_per_side": ids,
        "wall_ms": w.as_dict(),
        "cpu_ms": c.as_dict(),
        "fresh_wall_ms": Summary.of(fresh_wall).scaled(1e3).as_dict(),
        "pool_arrays_created": pool.created,
        "ns_per_id": json_number(c.median * 1e6 / ids if ids else float("nan")),
        "target_ms": TARGET_MS,
        "met": bool(w.median <= TARGET_MS),
        "met_cpu": bool(c.median <= TARGET_MS),
    }


def format_descids(result: dict[str, Any]) -> str:
    c, w, cpu = result["config"], result["wall_ms"], result["cpu_ms"]  # pooled arrays, as the service
    verdict = "met" if result["met"] else ("missed on wall time, met on CPU time" if result["met_cpu"] else "missed")
    return "\n".join(
        [
            f"bench descids: {c['model']}, prefill TP {c['prefill_tp']} -> decode TP {c['decode_tp']}, "
            f"{c['blocks']} kernel blocks of {c['kernel_block_size']} tokens ({c['tokens']} tokens), {c['repeat']} runs",
            f"descriptor ids per side: {result['ids_per_side']}",
            f"wall ms: median {w['median']}, p99 {w['p99']}, min {w['min']}",
            f"CPU ms:  median {cpu['median']}, p99 {cpu['p99']}, min {cpu['min']} ({result['ns_per_id']} ns per id)",
            f"into fresh arrays instead (a new size, page faults included), wall ms: median {result['fresh_wall_ms']['median']}",
            f"target <= {result['target_ms']} ms: {verdict}",
        ]
    )
