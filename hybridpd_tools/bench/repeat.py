"""`bench e2e --workload repeat`: the same prompts sent again and again (retries, regenerates,
several samples of one prompt), with and without decode's state checkpoints, in one run.

`prompts` random prompts of `prompt_tokens` tokens, each sent `repeats` times in a row to three
setups: `disaggregated` (a decode service with the prefix cache, --prefix-cache-blocks, but no
state checkpoints), `states` (a second decode service on the same prefill, with
--prefix-cache-states too) and `colocated`. Per repeat (1: the first time a prompt is seen):
TTFT in each setup, the bytes each decode service READ (attention, conv, SSM) and how many
requests restored a checkpoint instead of a prefill job and a READ, and whether every setup
generated the colocated tokens. The engine's boundary unless asked (full for hf: a repeat's
checkpoint then also holds the first token prefill drew, its requests being greedy); the hf
engine needs --prefill-chunk-tokens for any prefix reuse at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from hybridpd_tools.bench.client import Timed, generate
from hybridpd_tools.bench.progress import Progress
from hybridpd_tools.bench.setups import SetupConfig, flat_config, model_spec, start_setups
from hybridpd_tools.bench.sizing import blocks_needed
from hybridpd_tools.bench.stats import Summary, fixed, json_number, megabytes, ms_summary, ratio
from shared.layout.page import build_engine_layout
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc

SCHEMA = "hybrid-pd.bench.e2e.repeat/v1"
REPEAT_SETUPS = ("disaggregated", "states", "colocated")
DECODES = ("disaggregated", "states")  # the two decode services (colocated READs nothing)


@dataclass(frozen=True)
class RepeatConfig:
    setup: SetupConfig
    prompts: int = 3
    repeats: int = 3
    prompt_tokens: int = 2048
    max_tokens: int = 16
    warmup: int = 1  # unmeasured requests per setup first (other prompts)
    seed: int = 0


def run_rows(results: Sequence[dict[str, Timed]], repeat: int) -> dict[str, Any]:
    """The figures of one repeat index over the prompts."""
    errors = [r.error for x in results for r in x.values() if r.error]
    ok = [x for x in results if all(not r.error for r in x.values())]
    row: dict[str, Any] = {"repeat": repeat, "prompts": len(results), "errors": errors[:5], "ttft_ms": {}, "bytes": {}}
    for setup in REPEAT_SETUPS:
        row["ttft_ms"][setup] = ms_summary([x[setup].ttft for x in ok])
    for setup in DECODES:
        summaries = [x[setup].summary for x in ok if x[setup].summary is not None]
        row["bytes"][setup] = {
            "attention": sum(s.transfer.attention_bytes for s in summaries) // max(len(summaries), 1),
            "conv": sum(s.transfer.conv_bytes for s in summaries) // max(len(summaries), 1),
            "ssm": sum(s.transfer.ssm_bytes for s in summaries) // max(len(summaries), 1),
            "total": sum(s.transfer.total_bytes for s in summaries) // max(len(summaries), 1),
        }
        row[f"{setup}_state_reused"] = f"{sum(s.prefix_state_reused for s in summaries)}/{len(results)}"
    medians = {s: Summary.of([x[s].ttft for x in ok]).median for s in DECODES}
    row["ttft_states_over_disaggregated"] = json_number(ratio(medians["states"], medians["disaggregated"]))
    row["tokens_match"] = f"{sum(all(x[s].token_ids == x['colocated'].token_ids for s in DECODES) for x in ok)}/{len(results)}"
    return row


async def run_repeat(cfg: RepeatConfig, *, command: str, show_progress: bool = True) -> dict[str, Any]:
    spec = model_spec(cfg.setup.model, cfg.setup.engine)
    rng = np.random.default_rng(cfg.seed)
    layout = build_engine_layout(spec, cfg.setup.decode_tp, kernel_block_size=cfg.setup.kernel_block_size)
    cache_blocks = (cfg.prompts + cfg.warmup) * blocks_needed(layout, cfg.prompt_tokens)  # every prompt's chain
    progress = Progress("bench e2e repeat", len(REPEAT_SETUPS) * (cfg.warmup + cfg.prompts * cfg.repeats), enabled=show_progress)
    progress.advance(0, "starting services")
    per_prompt: list[list[dict[str, Timed]]] = []
    try:
        async with start_setups(
            spec,
            cfg.setup,
            prompt_tokens=cfg.prompt_tokens,
            max_tokens=cfg.max_tokens,
            name="bench-repeat",
            prefix_cache_blocks=cache_blocks,
            unpipelined=False,
            prefix_cache_states=cfg.prompts + cfg.warmup,
        ) as running:
            channels = {s: grpc.aio.insecure_channel(a) for s, a in running.addresses.items()}
            stubs = {s: pb_grpc.DecodeServiceStub(c) for s, c in channels.items()}
            try:
                for _ in range(cfg.warmup):  # lazy initialisation and wire-up: not measured
                    prompt = [int(t) for t in rng.integers(0, spec.vocab_size, cfg.prompt_tokens)]
                    for setup in REPEAT_SETUPS:
                        await generate(stubs[setup], prompt, cfg.max_tokens, ignore_eos=True)
                        progress.advance(1, f"warmup {setup}")
                for k in range(cfg.prompts):
                    prompt = [int(t) for t in rng.integers(0, spec.vocab_size, cfg.prompt_tokens)]
                    runs: list[dict[str, Timed]] = []
                    for r in range(cfg.repeats):
                        got: dict[str, Timed] = {}
                        for setup in REPEAT_SETUPS if (k + r) % 2 == 0 else REPEAT_SETUPS[::-1]:
                            got[setup] = await generate(stubs[setup], prompt, cfg.max_tokens, ignore_eos=True)
                            progress.advance(1, f"prompt {k + 1} repeat {r + 1} {setup}")
                        runs.append(got)
                    per_prompt.append(runs)
            finally:
                for channel in channels.values():
                    await channel.close()
    finally:
        progress.finish()
    rows = [run_rows([runs[r] for runs in per_prompt], r + 1) for r in range(cfg.repeats)]
    config = {**flat_config(cfg), "boundary": cfg.setup.resolved_boundary}
    return {"schema": SCHEMA, "command": command, "config": config, "repeats": rows}


def format_repeat(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"bench e2e --workload repeat: {c['model']} ({c['engine']} engine, {c['boundary']}), prefill TP {c['prefill_tp']} -> "
        f"decode TP {c['decode_tp']}, {c['prompts']} prompts of {c['prompt_tokens']} tokens, each sent {c['repeats']} "
        f"times, {c['max_tokens']} tokens out",
        "",
        f"{'repeat':>6} {'TTFT no-states ms':>17} {'TTFT states ms':>14} {'TTFT coloc ms':>13} {'states/no':>9} "
        f"{'READ MB no-states':>17} {'READ MB states':>14} {'restored':>8} {'same':>5}",
    ]
    for r in result["repeats"]:
        t, b = r["ttft_ms"], r["bytes"]
        lines.append(
            f"{r['repeat']:>6} {fixed(t['disaggregated']['median'], 1):>17} {fixed(t['states']['median'], 1):>14} "
            f"{fixed(t['colocated']['median'], 1):>13} {fixed(r['ttft_states_over_disaggregated'], 3):>9} "
            f"{megabytes(b['disaggregated']['total']):>17} {megabytes(b['states']['total']):>14} "
            f"{r['states_state_reused']:>8} {r['tokens_match']:>5}" + (f"  errors: {r['errors']}" if r["errors"] else "")
        )
    lines += [
        "",
        "no-states: decode with --prefix-cache-blocks only (a repeat READs the K/V after the cached blocks and the",
        "conv/SSM state); states: the same plus --prefix-cache-states (a repeat restores the state: no prefill job,",
        "no READ). READ MB: the mean per request; TTFT: the median over prompts.",
    ]
    return "\n".join(lines)
