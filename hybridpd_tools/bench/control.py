"""`bench control`: the control-plane cost of one request with a tiny state.

A real prefill service and a real decode service run in this process (grpc.aio on loopback,
real NIXL agents over UCX, the real completion poller; uvloop like the services), with an
engine that computes nothing (no_compute.py), so only the control plane is left. Per request,
driven through the decode service's own pieces:

  manifest   job over the Session stream -> manifest back (prefill: allocate, pin, reply)
  allocate   decode allocates the request's blocks
  read       decode_svc.reader.read_request: descriptor ids, one post per rank pair, polls to
             DONE (the tiny READ's copy is part of it)
    ids      of which: the read_indices calls alone (timed separately on the same manifest)
  notified   READ done -> prefill received the NIXL notification and freed the blocks
  free       decode frees its blocks
  total      manifest + allocate + read + notified + free

Also the whole Generate RPC (max_tokens 1) through the decode service's gRPC API, as a client
sees it (its critical path does not wait for prefill's free).

Beside each phase's wall clock, the event loop's CPU time over it (`time.thread_time` on the
loop's thread; p10 and median): the Python work the phase costs, which load on other cores
disturbs less than its wall clock. In this process both services and the client share that loop.
`--calls` adds two passes under a call counter on the loop thread (sys.setprofile; it slows every
call, so nothing else is timed there): the exact Python and C calls per step, per request and
per Generate RPC.

With `--separate-processes` the prefill service runs in a process of its own
(control_prefill.py), as in a deployment: the two services no longer share a GIL. `notified`
is then read from prefill's clock (the same monotonic clock in every process): from the moment
decode saw the READ done to the moment prefill freed the blocks, 0 when prefill was first.
`--breakdown` needs both services in this process.

Baselines from the same run: `echo`, one round trip over a bare grpc.aio bidirectional stream in
this process (the floor of `manifest`); `raw_read`, the same READ (identical descriptors, with
a notification) between plain NIXL agents (the floor of `read`; raw_nixl.py).

The benchmarks sit above the services: they import them, and the library below never does
(tests/unit/test_layering.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from decode_svc.app import DecodeApp
from decode_svc.reader import ReadStats, read_request
from hybridpd_tools.bench.client import generate
from hybridpd_tools.bench.control_prefill import PrefillProcess
from hybridpd_tools.bench.control_trace import (
    NOTIFICATION_WAIT_STEP,
    CallCounter,
    StepTrace,
    call_summary,
    cpu_summary_us,
    thread_hop_seconds,
    traced,
)
from hybridpd_tools.bench.echo import echo_round_trips
from hybridpd_tools.bench.no_compute import NoComputeEngine
from hybridpd_tools.bench.pairs import pair_lists, request_reads
from hybridpd_tools.bench.progress import Progress
from hybridpd_tools.bench.raw_nixl import RawReader, RawTarget
from hybridpd_tools.bench.sizing import prefill_tokens, request_blocks
from hybridpd_tools.bench.stats import Summary, json_number, ratio
from prefill_svc.app import PrefillApp
from shared import observe
from shared.config import parse_settings
from shared.layout.read_lists import read_indices
from shared.observe import Step
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.runtime.engine_host import layout_for
from shared.transport.read_fence import ReadFence

SCHEMA = "hybrid-pd.bench.control/v1"
TARGET_MEDIAN_MS = 1.0
NUM_BLOCKS = 64
PHASES = ("manifest", "allocate", "read", "ids", "notified", "free", "total", "generate_rpc")
BASELINES = ("echo", "raw_read")


@dataclass(frozen=True)
class ControlConfig:
    model: str = "tiny-mamba2"
    prefill_tp: int = 1
    decode_tp: int = 1
    prompt_tokens: int = 8
    requests: int = 200
    warmup: int = 20
    breakdown: bool = False  # one more pass of `requests`, timed step by step (control_trace.py)
    separate_processes: bool = False  # prefill in a process of its own (control_prefill.py)
    calls: bool = False  # two more passes counting the loop thread's calls per step, request and Generate

    def __post_init__(self) -> None:
        if self.breakdown and self.separate_processes:
            raise ValueError("--breakdown times both services step by step in this process: drop --separate-processes")
        if self.calls and self.separate_processes:
            raise ValueError("--calls counts both services' calls on one event loop: drop --separate-processes")


def cache_blocks(cfg: ControlConfig) -> int:
    """Logical blocks of each side's cache: NUM_BLOCKS, or as many as one request of the prompt needs."""
    need = 0
    for tp in (cfg.prefill_tp, cfg.decode_tp):
        layout = layout_for(parse_settings("prefill", ["--model", cfg.model, "--tp", str(tp)], environ={}))
        need = max(need, sum(layout.blocks_per_group(cfg.prompt_tokens + 1)))
    return max(NUM_BLOCKS, need)


async def run_control(cfg: ControlConfig, *, command: str, show_progress: bool = True) -> dict[str, Any]:
    num_blocks = cache_blocks(cfg)
    base = ["--host", "127.0.0.1", "--port", "0", "--model", cfg.model, "--num-blocks", str(num_blocks), "--log-level", "WARNING"]
    prefill_flags = [*base, "--tp", str(cfg.prefill_tp), "--engine-id", "bench-control-prefill"]
    prefill_settings = parse_settings("prefill", prefill_flags, environ={})
    prefill_app: Any = None
    prefill_proc: PrefillProcess | None = None
    if cfg.separate_processes:
        prefill_layout = layout_for(prefill_settings)  # bad flags fail here, in one line, before the start
        prefill_proc = await PrefillProcess.start(prefill_flags)
        prefill_port = prefill_proc.port
    else:
        prefill_app = await PrefillApp.start(prefill_settings, NoComputeEngine)
        prefill_port, prefill_layout = prefill_app.port, prefill_app.host.layout
    decode_app: Any = None
    raw_target: RawTarget | None = None
    raw_reader: RawReader | None = None
    try:
        decode_settings = parse_settings(
            "decode",
            # Reuse off: every request pays the path measured here (a repeated prompt would skip it).
            [
                *base,
                "--tp",
                str(cfg.decode_tp),
                "--engine-id",
                "bench-control-decode",
                "--prefix-cache-blocks",
                "0",
                "--prefill",
                f"127.0.0.1:{prefill_port}",
            ],
            environ={},
        )
        decode_app = await DecodeApp.start(decode_settings, NoComputeEngine)
        await decode_app.wait_ready(30)
        host = decode_app.host
        peer = decode_app.peers.pick()
        session, link = peer.session, peer.link
        owner = "" if prefill_app is None else _owner_key(prefill_app, decode_settings.engine_id, host.incarnation)
        prompt = [1 + i % (host.spec.vocab_size - 1) for i in range(cfg.prompt_tokens)]  # ids in the vocabulary
        samples: dict[str, list[float]] = {p: [] for p in (*PHASES, *BASELINES)}
        loop_cpu: dict[str, list[float]] = {p: [] for p in PHASES if p != "ids"}  # ids: timed apart
        counter = CallCounter()
        counted = StepTrace(counter=counter)  # the --calls pass
        calls: dict[str, list[tuple[int, int]]] = {"request": [], "generate_rpc": []}
        trace = StepTrace()
        hops: list[float] = []  # bare thread hops, measured with --breakdown
        raw_target = RawTarget(cfg.prefill_tp, prefill_layout.num_regions, prefill_layout.region_bytes(num_blocks))
        raw_reader = RawReader(raw_target, cfg.decode_tp, host.layout.num_regions, host.layout.region_bytes(num_blocks))
        tokens = prefill_tokens(host.spec, cfg.prompt_tokens)
        raw_reads = [
            raw_reader.prepare(
                r.pair.decode_rank, r.pair.prefill_rank, r.pair.lists.local, r.pair.lists.remote, r.local_idx, r.remote_idx
            )
            for r in request_reads(
                pair_lists(
                    link.plan,
                    local_bases=[raw_reader.bases(d) for d in range(cfg.decode_tp)],
                    remote_bases=[t.bases for t in raw_target.ranks],
                    local_num_blocks=num_blocks,
                    remote_num_blocks=num_blocks,
                ),
                request_blocks(host.layout, cfg.prompt_tokens + 1),
                request_blocks(prefill_layout, tokens),
                tokens,
            )
        ]
        total_rounds = cfg.warmup + cfg.requests

        def pin_end(rid: str) -> Callable[[], Awaitable[float]]:
            """After the manifest: an awaitable of the moment prefill ended the request's pin."""
            if prefill_proc is not None:
                return lambda: prefill_proc.pin_ended_at(rid)
            pin = prefill_app.pins.lookup(owner, rid)
            if pin is None or pin.outcome is None:
                raise RuntimeError(f"prefill holds no pin for {rid} (owner {owner}): cannot time its free")
            outcome = pin.outcome

            async def ended() -> float:
                await asyncio.shield(outcome)
                return time.perf_counter()

            return ended

        async def one_request(rid: str) -> tuple[dict[str, float], dict[str, float], ReadStats]:
            """One request through decode's pieces: seconds per phase, wall clock and loop CPU."""
            c0, t0 = time.thread_time(), time.perf_counter()
            manifest = await session.submit(rid, prompt, 30.0)
            t1, c1 = time.perf_counter(), time.thread_time()
            pin_ended = pin_end(rid)
            ca0, a0 = time.thread_time(), time.perf_counter()
            local = host.allocate(rid, len(prompt) + 1)
            t2, c2 = time.perf_counter(), time.thread_time()
            observe.mark(Step.READ_START)  # no-ops outside the traced pass
            reads = ReadFence()
            stats = await read_request(host, link, manifest, local, timeout=30.0, fence=reads)
            observe.mark(Step.READ_END)
            t3, c3 = time.perf_counter(), time.thread_time()
            session.done_reading(rid)
            # Prefill, in its own process, may free the blocks before decode's loop saw DONE.
            notified = max(0.0, await pin_ended() - t3)
            cn = time.thread_time()
            cf0, f0 = time.thread_time(), time.perf_counter()
            reads.when_released(lambda: host.free(rid))
            f1, cf1 = time.perf_counter(), time.thread_time()
            remote = manifest.block_ids
            i0 = time.perf_counter()
            for pair in link.pairs:
                read_indices(pair.lists, local.block_ids, remote, manifest.num_computed_tokens)
            i1 = time.perf_counter()
            phases = {
                "manifest": t1 - t0,
                "allocate": t2 - a0,
                "read": t3 - t2,
                "ids": i1 - i0,
                "notified": notified,
                "free": f1 - f0,
                "total": (t1 - t0) + (t2 - a0) + (t3 - t2) + notified + (f1 - f0),
            }
            cpu = {
                "manifest": c1 - c0,
                "allocate": c2 - ca0,
                "read": c3 - c2,
                "notified": cn - c3,
                "free": cf1 - cf0,
                "total": (c1 - c0) + (c2 - ca0) + (c3 - c2) + (cn - c3) + (cf1 - cf0),
            }
            return phases, cpu, stats

        rounds = 2 * total_rounds + (cfg.requests if cfg.breakdown else 0) + (2 * cfg.requests if cfg.calls else 0)
        with Progress("bench control", rounds, enabled=show_progress) as progress:
            for i in range(total_rounds):
                phases, cpu, stats = await one_request(f"bench-control-{i}")
                raw_read = raw_reader.run(raw_reads, f"bench-control-raw-{i}".encode())
                if i >= cfg.warmup:
                    samples["raw_read"].append(raw_read)
                    for name, value in phases.items():
                        samples[name].append(value)
                    for name, value in cpu.items():
                        loop_cpu[name].append(value)
                progress.advance()
            if cfg.breakdown:
                # A separate pass: each mark costs a few microseconds the phases above must not carry.
                with traced(trace):
                    for i in range(cfg.requests):
                        trace.begin()
                        await one_request(f"bench-control-traced-{i}")
                        trace.end()
                        progress.advance()
                hops = await thread_hop_seconds(cfg.requests)
            if cfg.calls:
                with counter.counting(), traced(counted):
                    for i in range(cfg.requests):
                        counted.begin()
                        before = (counter.python, counter.c)
                        await one_request(f"bench-control-counted-{i}")
                        calls["request"].append((counter.python - before[0], counter.c - before[1]))
                        counted.end()
                        progress.advance()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{decode_app.port}") as channel:
                stub = pb_grpc.DecodeServiceStub(channel)

                async def one_rpc(rid: str) -> tuple[float, float]:
                    c0 = time.thread_time()
                    timed = await generate(stub, prompt, 1, request_id=rid)
                    c1 = time.thread_time()
                    if timed.error:
                        raise RuntimeError(f"Generate failed: {timed.error}")
                    return timed.done - timed.sent, c1 - c0

                for i in range(total_rounds):
                    wall, cpu_s = await one_rpc(f"bench-control-rpc-{i}")
                    if i >= cfg.warmup:
                        samples["generate_rpc"].append(wall)
                        loop_cpu["generate_rpc"].append(cpu_s)
                    progress.advance()
                if cfg.calls:
                    with counter.counting():
                        for i in range(cfg.requests):
                            before = (counter.python, counter.c)
                            await one_rpc(f"bench-control-rpc-counted-{i}")
                            calls["generate_rpc"].append((counter.python - before[0], counter.c - before[1]))
                            progress.advance()
            samples["echo"] = (await echo_round_trips(total_rounds))[cfg.warmup :]
        leftover = await _blocks_left(prefill_app, prefill_proc), host.allocator.num_used
    finally:
        if raw_reader is not None:
            raw_reader.close()
        if raw_target is not None:
            raw_target.close()
        if decode_app is not None:
            await decode_app.stop()
        if prefill_app is not None:
            await prefill_app.stop()
        if prefill_proc is not None:
            await prefill_proc.stop()
    ms = {name: Summary.of(values).scaled(1e3).as_dict() for name, values in samples.items()}
    total_median = ms["total"]["median"]
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command,
        "config": {
            "model": cfg.model,
            "prefill_tp": cfg.prefill_tp,
            "decode_tp": cfg.decode_tp,
            "prompt_tokens": cfg.prompt_tokens,
            "requests": cfg.requests,
            "warmup": cfg.warmup,
            "engine": "no-compute",
            "in_process": not cfg.separate_processes,
            "breakdown": cfg.breakdown,
            "calls": cfg.calls,
        },
        "ms": ms,
        "loop_cpu_us": {name: cpu_summary_us(values) for name, values in loop_cpu.items()},
        "median_ms": total_median,
        "p99_ms": ms["total"]["p99"],
        "ratios": {
            "manifest_vs_echo": json_number(ratio(ms["manifest"]["median"] or 0.0, ms["echo"]["median"] or 0.0)),
            "read_vs_raw_read": json_number(ratio(ms["read"]["median"] or 0.0, ms["raw_read"]["median"] or 0.0)),
        },
        "target_median_ms": TARGET_MEDIAN_MS,
        "met": total_median is not None and total_median <= TARGET_MEDIAN_MS,
        "blocks_in_use_after": {"prefill": int(leftover[0]), "decode": int(leftover[1])},
        "bytes_per_request": stats.total_bytes,
        "descriptors_per_request": stats.descriptor_count,
        "reads_per_request": stats.read_count,
    }
    if cfg.breakdown:
        result["breakdown"] = _breakdown(trace, ms, Summary.of(hops).scaled(1e3).median)
    if cfg.calls:
        result["calls"] = {
            "steps": counted.call_summaries(),
            "request": call_summary(calls["request"]),
            "generate_rpc": call_summary(calls["generate_rpc"]),
        }
    return result


def _breakdown(trace: StepTrace, phases: dict[str, Any], hop_ms: float) -> dict[str, Any]:
    """The traced pass's steps, and the floor of this design on this machine from the same run."""
    echo, raw = phases["echo"]["median"] or 0.0, phases["raw_read"]["median"] or 0.0
    steps = trace.summaries_ms()
    # Prefill pumps its agent every busy interval while notifications are awaited: the READ's
    # notification waits for the next pump (by design: a shorter interval costs CPU per rank).
    # Its two marks lie on two services' threads with no order between them (the pump may fetch
    # the notification before decode's post returns), so a median below 0 is a wait of 0.
    wait = max(0.0, next(s["median"] for s in steps if s["step"] == NOTIFICATION_WAIT_STEP) or 0.0)
    floors = {
        "echo_ms": echo,  # the job and its manifest cross the Session stream once each way
        # Paid once: the compute thread. A READ this small is posted on the event loop itself
        # (transport/agent.py, INLINE_MAX_BYTES), so the agent's owner thread is not in its path.
        "thread_hop_ms": json_number(hop_ms),
        "raw_read_ms": raw,
        "notification_wait_ms": wait,
    }
    floor = echo + hop_ms + raw + wait
    return {"steps": steps, "floors": floors, "design_floor_ms": json_number(floor)}


async def _blocks_left(prefill_app: Any, prefill_proc: PrefillProcess | None, wait: float = 5.0) -> int:
    """Prefill's blocks in use at the end. The last Generate's pin ends when prefill's pump
    fetches its notification, so wait a little for that before counting what is left."""
    end = time.monotonic() + wait
    while True:
        used = int(prefill_app.host.allocator.num_used) if prefill_proc is None else await prefill_proc.blocks_in_use()
        if used == 0 or time.monotonic() > end:
            return used
        await asyncio.sleep(0.01)


def _owner_key(prefill_app: Any, engine_id: str, incarnation: int) -> str:
    """How the prefill service keys the pins of this decode engine (its handshaken incarnation)."""
    peer = prefill_app.servicer.peers.get(engine_id, incarnation)
    return str(peer.key) if peer is not None else engine_id


def format_control(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"bench control: {c['model']}, prefill TP {c['prefill_tp']} -> decode TP {c['decode_tp']}, "
        f"prompt {c['prompt_tokens']} tokens, {c['requests']} requests (+{c['warmup']} warm-up), "
        + ("services in this process" if c["in_process"] else "prefill in a process of its own"),
        "",
        f"{'phase':<14} {'median ms':>10} {'p99 ms':>9} {'min ms':>9}   {'loop CPU p10 us':>15} {'median us':>10}",
    ]
    for name in (*PHASES, *BASELINES):
        if name == "echo":
            lines.append("baselines (same run):")
        s = result["ms"][name]
        cpu = result["loop_cpu_us"].get(name)
        label = f"  {name}" if name in ("ids", *BASELINES) else name
        line = f"{label:<14} {_f(s['median']):>10} {_f(s['p99']):>9} {_f(s['min']):>9}"
        if cpu is not None:
            line += f"   {_us(cpu['p10']):>15} {_us(cpu['median']):>10}"
        lines.append(line)
    if "breakdown" in result:
        lines += ["", *_format_breakdown(result["breakdown"])]
    if "calls" in result:
        lines += ["", *_format_calls(result["calls"])]
    verdict = "met" if result["met"] else "missed"
    r = result["ratios"]
    lines += [
        "",
        f"manifest / echo = {_f(r['manifest_vs_echo'])}, read / raw_read = {_f(r['read_vs_raw_read'])}",
        "",
        f"control-plane cost per request (total): median {_f(result['median_ms'])} ms, p99 {_f(result['p99_ms'])} ms "
        f"(target median <= {result['target_median_ms']} ms: {verdict})",
    ]
    return "\n".join(lines)


def _format_breakdown(b: dict[str, Any]) -> list[str]:
    lines = [f"{'step (separate traced pass)':<56} {'median ms':>10} {'p99 ms':>9}   {'loop CPU p10 us':>15} {'median us':>10}"]
    for step in b["steps"]:
        cpu = step["loop_cpu_us"]  # "-": a mark of the step lies off the event loop
        lines.append(
            f"{step['step']:<56} {_f(step['median']):>10} {_f(step['p99']):>9}   {_us(cpu['p10']):>15} {_us(cpu['median']):>10}"
        )
    f = b["floors"]
    lines += [
        "",
        f"floor of this design here: echo {_f(f['echo_ms'])} + thread hop {_f(f['thread_hop_ms'])} "
        f"+ raw READ {_f(f['raw_read_ms'])} + notification wait {_f(f['notification_wait_ms'])} "
        f"= {_f(b['design_floor_ms'])} ms",
    ]
    return lines


def _format_calls(c: dict[str, Any]) -> list[str]:
    lines = [f"{'calls on the event loop (counted pass)':<56} {'Python':>10} {'C':>9}   (mean per request)"]
    for step in c["steps"]:
        if step["count"]:  # steps with a mark off the loop have no count
            lines.append(f"{step['step']:<56} {_n(step['python_mean']):>10} {_n(step['c_mean']):>9}")
    for name, label in (("request", "whole request (the phases above)"), ("generate_rpc", "Generate RPC (client included)")):
        lines.append(f"{label:<56} {_n(c[name]['python_mean']):>10} {_n(c[name]['c_mean']):>9}")
    return lines


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
