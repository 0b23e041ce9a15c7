"""`bench e2e`: time to first token, inter-token latency and tokens/s, disaggregated vs colocated.

Both setups run side by side in the same run and get the same prompts at each concurrency
level; each level's requests are cut into `interleave` parts run alternately on the two setups
(drift on a shared machine hits both alike; wall and CPU time add up over a setup's parts):
- disaggregated: a prefill and a decode service (local subprocesses, `--engine`),
- colocated: colocated_server.py, the same engine prefilling and decoding in one process.
Times are taken by the client (client.py). Throughput per core divides tokens/s by the cores
the serving processes actually used (their CPU seconds over the level's wall time), so two
processes are not credited with a core each they did not use. The generated tokens of both
setups are compared request by request (`tokens_match`): the disaggregated path must not
change them.

With `--engine hf --model DIR` both setups run the checkpoint with transformers. Requests
ignore EOS, so every request generates max_tokens tokens in both setups. The share of TTFT
spent moving state is the decode-reported READ time over the client's TTFT, per request.

The crossover (bytes moved against prompt length) comes from the layout math (crossover.py).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from hybridpd_tools.bench.client import Timed, generate, seconds
from hybridpd_tools.bench.cpu import process_cpu_seconds
from hybridpd_tools.bench.crossover import DEFAULT_LENGTHS, bytes_by_prompt_length
from hybridpd_tools.bench.plotting import Chart, Series
from hybridpd_tools.bench.progress import Progress
from hybridpd_tools.bench.setups import SETUPS, SetupConfig, flat_config, model_spec, start_setups
from hybridpd_tools.bench.stats import Summary, fixed, json_number, ratio
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc

SCHEMA = "hybrid-pd.bench.e2e/v1"
# TTFT disaggregated / colocated at 2k-token prompts, per boundary: at full-N the first token is
# prefill's own sample, streamed before the READ; at N-1 decode computes it after the READ.
TARGET_TTFT_RATIO = {"full": 1.02, "n-1": 1.10}


DEFAULT_SETUP = SetupConfig(model="tiny-mamba2", engine="reference")


@dataclass(frozen=True)
class E2EConfig:
    setup: SetupConfig = DEFAULT_SETUP
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    prompt_tokens: int = 128
    max_tokens: int = 32
    requests_per_level: int = 0  # 0: max(4, 2 x concurrency)
    warmup: int = 2  # unmeasured requests per setup before the first level
    interleave: int = 2  # parts per level, alternating between the setups
    crossover_model: str = ""  # "": the same model
    seed: int = 0

    def requests_at(self, concurrency: int) -> int:
        return self.requests_per_level or max(4, 2 * concurrency)


@dataclass
class LevelResult:
    setup: str
    concurrency: int
    timings: list[Timed]
    wall: float
    cpu_seconds: float | None

    def add(self, part: LevelResult) -> None:
        """Fold in another part of the same level and setup."""
        self.timings += part.timings
        self.wall += part.wall
        self.cpu_seconds = None if self.cpu_seconds is None or part.cpu_seconds is None else self.cpu_seconds + part.cpu_seconds

    def as_dict(self) -> dict[str, Any]:
        ok = [t for t in self.timings if not t.error]
        tokens = sum(len(t.token_ids) for t in ok)
        rate = tokens / self.wall if self.wall > 0 else math.nan
        cores = self.cpu_seconds / self.wall if self.cpu_seconds is not None and self.wall > 0 else math.nan
        return {
            "setup": self.setup,
            "concurrency": self.concurrency,
            "requests": len(self.timings),
            "errors": [t.error for t in self.timings if t.error][:5],
            "ttft_ms": Summary.of([t.ttft for t in ok if not math.isnan(t.ttft)]).scaled(1e3).as_dict(),
            # TTFT minus the server-reported prefill time (job sent -> manifest, or the colocated
            # prefill call): everything but the prefill compute, including the transfer.
            "ttft_minus_prefill_ms": Summary.of(
                [t.ttft - seconds(t.summary.prefill_duration) for t in ok if t.summary is not None and not math.isnan(t.ttft)]
            )
            .scaled(1e3)
            .as_dict(),
            "prefill_ms": Summary.of([seconds(t.summary.prefill_duration) for t in ok if t.summary is not None])
            .scaled(1e3)
            .as_dict(),
            # The prefill engine's own model calls, and TTFT minus them: what the setup adds to the
            # compute (network hops, queueing, digests, pin, streaming), free of the compute's spread.
            "engine_prefill_ms": Summary.of(_engine_seconds(ok)).scaled(1e3).as_dict(),
            "ttft_minus_engine_ms": Summary.of(
                [t.ttft - seconds(t.summary.prefill_engine_duration) for t in _with_engine_time(ok) if not math.isnan(t.ttft)]
            )
            .scaled(1e3)
            .as_dict(),
            # Decode's READ time (first READ posted -> last done) and its share of each request's TTFT.
            "read_ms": Summary.of([seconds(t.summary.read_duration) for t in ok if t.summary is not None]).scaled(1e3).as_dict(),
            "read_share_of_ttft": Summary.of(
                [seconds(t.summary.read_duration) / t.ttft for t in ok if t.summary is not None and t.ttft > 0]
            ).as_dict(6),
            "itl_ms": Summary.of([t.itl for t in ok if not math.isnan(t.itl)]).scaled(1e3).as_dict(),
            # From the last token to the end of the stream: what the request still waits for once
            # its tokens are out (the summary; at max_tokens 1, anything that waits for prefill's manifest).
            "after_last_token_ms": Summary.of([t.done - t.last_token for t in ok if t.last_token is not None])
            .scaled(1e3)
            .as_dict(),
            "tokens": tokens,
            "wall_s": json_number(self.wall),
            "tokens_per_s": json_number(rate),
            "cpu_cores_used": json_number(cores),
            "tokens_per_s_per_core": json_number(rate / cores if cores and not math.isnan(cores) else math.nan),
        }


def _with_engine_time(timings: list[Timed]) -> list[Timed]:
    """The requests whose summary reports the prefill engine's time (zero: a server that does not)."""
    return [t for t in timings if t.summary is not None and seconds(t.summary.prefill_engine_duration) > 0]


def _engine_seconds(timings: list[Timed]) -> list[float]:
    return [seconds(t.summary.prefill_engine_duration) for t in _with_engine_time(timings)]


def compute_matched_ratio(d: dict[str, Any], col: dict[str, Any]) -> float:
    """TTFT d/c with both setups given the colocated median engine time: (engine + d's TTFT
    minus engine) / (engine + c's TTFT minus engine). The same engine code computes the prompt in
    both; on a shared machine its spread alone moves the plain ratio by more than the targets."""
    engine = col["engine_prefill_ms"]["median"]
    extra_d, extra_c = d["ttft_minus_engine_ms"]["median"], col["ttft_minus_engine_ms"]["median"]
    if engine is None or extra_d is None or extra_c is None:
        return math.nan
    return ratio(engine + extra_d, engine + extra_c)


def _parts(count: int, parts: int) -> list[range]:
    """`count` request indices cut into at most `parts` consecutive, non-empty ranges."""
    n = max(1, min(parts, count))
    bounds = [round(i * count / n) for i in range(n + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(n)]


def _prompts(cfg: E2EConfig, vocab: int, count: int, level: int) -> list[list[int]]:
    rng = np.random.default_rng([cfg.seed, level + 1])
    return [rng.integers(0, vocab, cfg.prompt_tokens).tolist() for _ in range(count)]


async def _level(
    setup: str, address: str, pids: Sequence[int], prompts: list[list[int]], cfg: E2EConfig, concurrency: int, progress: Progress
) -> LevelResult:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, stub: pb_grpc.DecodeServiceAsyncStub) -> Timed:
        async with sem:
            timed = await generate(stub, prompts[i], cfg.max_tokens, ignore_eos=True)
        progress.advance(1, f"{setup} c={concurrency}")
        return timed

    cpu_before = [process_cpu_seconds(p) for p in pids]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        started = time.perf_counter()
        timings = await asyncio.gather(*(one(i, stub) for i in range(len(prompts))))
        wall = time.perf_counter() - started
    cpu_after = [process_cpu_seconds(p) for p in pids]
    used: float | None = 0.0
    for before, after in zip(cpu_before, cpu_after):
        used = None if used is None or before is None or after is None else used + after - before
    return LevelResult(setup, concurrency, list(timings), wall, used)


async def run_e2e(cfg: E2EConfig, *, command: str, show_progress: bool = True) -> dict[str, Any]:
    spec = model_spec(cfg.setup.model, cfg.setup.engine)
    total = 2 * (cfg.warmup + sum(cfg.requests_at(c) for c in cfg.concurrency))
    progress = Progress("bench e2e", total, enabled=show_progress)
    progress.advance(0, "starting services")
    levels: list[LevelResult] = []
    try:
        async with start_setups(
            spec,
            cfg.setup,
            prompt_tokens=cfg.prompt_tokens,
            max_tokens=cfg.max_tokens,
            concurrent=max(cfg.concurrency),
        ) as running:
            address, pids = running.addresses, running.pids
            if cfg.warmup:  # first requests pay for lazy initialisation (torch, wire-up): not measured
                warm = _prompts(cfg, spec.vocab_size, cfg.warmup, -1)
                for setup in SETUPS:
                    await _level(setup, address[setup], pids[setup], warm, cfg, 1, progress)
            for level, c in enumerate(cfg.concurrency):
                prompts = _prompts(cfg, spec.vocab_size, cfg.requests_at(c), level)
                results = {setup: LevelResult(setup, c, [], 0.0, 0.0) for setup in SETUPS}
                for part in _parts(len(prompts), cfg.interleave):
                    for setup in SETUPS:
                        results[setup].add(
                            await _level(setup, address[setup], pids[setup], [prompts[i] for i in part], cfg, c, progress)
                        )
                levels += results.values()
    finally:
        progress.finish()
    cross_spec = load_model(cfg.crossover_model) if cfg.crossover_model else spec
    crossover = bytes_by_prompt_length(
        build_engine_layout(cross_spec, cfg.setup.prefill_tp, kernel_block_size=cfg.setup.kernel_block_size),
        build_engine_layout(cross_spec, cfg.setup.decode_tp, kernel_block_size=cfg.setup.kernel_block_size),
        DEFAULT_LENGTHS,
    )
    return build_e2e_result(cfg, levels, crossover.as_dict(), command)


def build_e2e_result(cfg: E2EConfig, levels: list[LevelResult], crossover: dict[str, Any], command: str) -> dict[str, Any]:
    rows = [lv.as_dict() for lv in levels]
    by_level: dict[int, dict[str, LevelResult]] = {}
    for lv in levels:
        by_level.setdefault(lv.concurrency, {})[lv.setup] = lv
    comparisons = []
    for c, pair in sorted(by_level.items()):
        if len(pair) < 2:
            continue
        d, col = pair["disaggregated"].as_dict(), pair["colocated"].as_dict()
        same = [a.token_ids == b.token_ids for a, b in zip(pair["disaggregated"].timings, pair["colocated"].timings)]
        comparisons.append(
            {
                "concurrency": c,
                "ttft_ratio": json_number(ratio(d["ttft_ms"]["median"] or math.nan, col["ttft_ms"]["median"] or math.nan)),
                "ttft_ratio_compute_matched": json_number(compute_matched_ratio(d, col)),
                "engine_prefill_ratio": json_number(
                    ratio(d["engine_prefill_ms"]["median"] or math.nan, col["engine_prefill_ms"]["median"] or math.nan)
                ),
                "itl_ratio": json_number(ratio(d["itl_ms"]["median"] or math.nan, col["itl_ms"]["median"] or math.nan)),
                "tokens_per_s_ratio": json_number(ratio(d["tokens_per_s"] or math.nan, col["tokens_per_s"] or math.nan)),
                "tokens_per_s_per_core_ratio": json_number(
                    ratio(d["tokens_per_s_per_core"] or math.nan, col["tokens_per_s_per_core"] or math.nan)
                ),
                "tokens_match": f"{sum(same)}/{len(same)}",
            }
        )
    first = comparisons[0] if comparisons else None
    first_ratio = first["ttft_ratio"] if first else None
    matched = first["ttft_ratio_compute_matched"] if first else None
    target = TARGET_TTFT_RATIO[cfg.setup.resolved_boundary]
    return {
        "schema": SCHEMA,
        "command": command,
        "config": flat_config(cfg) | {"concurrency": list(cfg.concurrency)},
        "levels": rows,
        "comparisons": comparisons,
        "target": {
            "boundary": cfg.setup.resolved_boundary,
            "ttft_ratio_at_most": target,
            "at_concurrency": first["concurrency"] if first else None,
            "value": first_ratio,
            "met": isinstance(first_ratio, float) and first_ratio <= target,
            "compute_matched_value": matched,
            "compute_matched_met": isinstance(matched, float) and matched <= target,
        },
        "crossover": crossover,
    }


def e2e_charts(result: dict[str, Any]) -> list[tuple[str, Chart]]:
    """(file tag, chart): throughput per core, TTFT and ITL against concurrency; bytes against prompt length."""
    c = result["config"]

    def series(key: str, sub: str | None = None) -> list[Series]:
        out = []
        for setup in SETUPS:
            rows = [r for r in result["levels"] if r["setup"] == setup]
            ys = [_nan(r[key][sub] if sub else r[key]) for r in rows]
            out.append(Series(setup, [r["concurrency"] for r in rows], ys))
        return out

    x = result["crossover"]
    lengths = x["prompt_tokens"]
    what = f"{c['model']}, {c['engine']} engine, {c['prompt_tokens']}-token prompts"
    return [
        ("throughput", Chart(f"Tokens/s per core used ({what})", "concurrency", "tokens/s per core",
                             series("tokens_per_s_per_core"), log2_x=True)),
        ("ttft", Chart(f"Time to first token, median ({what})", "concurrency", "ms", series("ttft_ms", "median"), log2_x=True)),
        ("itl", Chart(f"Inter-token latency, median ({what})", "concurrency", "ms", series("itl_ms", "median"), log2_x=True)),
        ("crossover", Chart(
            f"Bytes moved per request ({c['crossover_model'] or c['model']}, TP {c['prefill_tp']}->{c['decode_tp']})",
            "prompt tokens", "MB",
            [
                Series("attention K/V", lengths, [v / 1e6 for v in x["fa_bytes"]]),
                Series("conv + SSM state", lengths, [(a + b) / 1e6 for a, b in zip(x["conv_bytes"], x["ssm_bytes"])]),
                Series("total", lengths, [v / 1e6 for v in x["total_bytes"]]),
            ],
            log2_x=True,
            log10_y=True,
        )),
    ]  # fmt: skip


def _nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def format_e2e(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"bench e2e: {c['model']} ({c['engine']} engine), prefill TP {c['prefill_tp']} -> decode TP {c['decode_tp']}, "
        f"prompt {c['prompt_tokens']} tokens, {c['max_tokens']} new tokens per request",
        "",
        f"{'setup':<14} {'conc':>4} {'reqs':>4} {'TTFT p50 ms':>11} {'TTFT p99':>9} {'-prefill':>9} {'engine':>8} "
        f"{'-engine':>8} {'ITL p50 ms':>10} {'tok/s':>8} {'cores':>6} {'tok/s/core':>10}",
    ]
    for r in result["levels"]:
        lines.append(
            f"{r['setup']:<14} {r['concurrency']:>4} {r['requests']:>4} {fixed(r['ttft_ms']['median'], 1):>11} "
            f"{fixed(r['ttft_ms']['p99'], 1):>9} {fixed(r['ttft_minus_prefill_ms']['median'], 1):>9} "
            f"{fixed(r['engine_prefill_ms']['median'], 1):>8} {fixed(r['ttft_minus_engine_ms']['median'], 2):>8} "
            f"{fixed(r['itl_ms']['median'], 2):>10} {fixed(r['tokens_per_s'], 1):>8} "
            f"{fixed(r['cpu_cores_used'], 2):>6} {fixed(r['tokens_per_s_per_core'], 1):>10}"
            + (f"  errors: {r['errors']}" if r["errors"] else "")
        )
    lines.append("(-prefill: median TTFT minus the server-reported prefill time: transfer, control plane, first decode step)")
    lines.append(
        "(engine: the prefill engine's own model calls; -engine: median TTFT minus them, all the setup adds to the compute)"
    )
    for r in result["levels"]:
        after = r["after_last_token_ms"]["median"]
        lines.append(
            f"{r['setup']} at concurrency {r['concurrency']}: the stream ends {fixed(after, 2)} ms after the last token (p50)"
        )
    for r in result["levels"]:
        if r["setup"] == "disaggregated" and r["read_ms"]["median"] is not None:
            lines.append(
                f"moving state at concurrency {r['concurrency']}: READ p50 {fixed(r['read_ms']['median'], 2)} ms, "
                f"{fixed(100 * (r['read_share_of_ttft']['median'] or 0), 2)} % of TTFT (median over requests)"
            )
    lines += [
        "",
        f"{'conc':>4} {'TTFT d/c':>9} {'matched':>8} {'engine d/c':>10} {'ITL d/c':>8} {'tok/s d/c':>10} "
        f"{'tok/s/core d/c':>15} {'same tokens':>12}",
    ]
    for cmp in result["comparisons"]:
        lines.append(
            f"{cmp['concurrency']:>4} {fixed(cmp['ttft_ratio'], 3):>9} {fixed(cmp.get('ttft_ratio_compute_matched'), 3):>8} "
            f"{fixed(cmp.get('engine_prefill_ratio'), 3):>10} {fixed(cmp['itl_ratio'], 3):>8} {fixed(cmp['tokens_per_s_ratio'], 3):>10} "
            f"{fixed(cmp['tokens_per_s_per_core_ratio'], 3):>15} {cmp['tokens_match']:>12}"
        )
    t = result["target"]
    x = result["crossover"]
    lines += [
        "",
        f"TTFT disaggregated / colocated at concurrency {t['at_concurrency']}: {fixed(t['value'], 3)} "
        f"(target at the {t.get('boundary', 'n-1')} boundary <= {t['ttft_ratio_at_most']}: {'met' if t['met'] else 'missed'}); "
        f"compute-matched {fixed(t.get('compute_matched_value'), 3)} ({'met' if t.get('compute_matched_met') else 'missed'})",
        "(matched: TTFT d/c with both setups given the colocated median engine time, so the compute's spread cancels)",
        f"bytes moved: FA grows with the prompt, conv + SSM do not; FA reaches conv + SSM at ~"
        f"{fixed(x['crossover_estimate_tokens'], 0)} prompt tokens ({c['crossover_model'] or c['model']})",
    ]
    return "\n".join(lines)


def parse_levels(text: str, what: str = "concurrency level") -> tuple[int, ...]:
    """ "1,2,4,8" -> (1, 2, 4, 8); each value >= 1, no repeats, kept in the order given (also the
    prompt lengths of the long-prompt workload, `what` naming them in the messages)."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise ValueError(f"give at least one {what}")
    try:
        levels = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{what}s must be integers, got {text!r}") from None
    if any(v < 1 for v in levels):
        raise ValueError(f"{what}s must be >= 1")
    if len(set(levels)) != len(levels):
        raise ValueError(f"{what}s repeat")
    return levels
