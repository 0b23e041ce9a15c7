"""`bench e2e --workload long-prompt`: what moving the state adds to TTFT at long prompts.

At each prompt length, the same prompts go to both setups (setups.py), one request at a time,
alternating which setup goes first, so drift on a shared machine hits both alike. Per length:
- exposed transfer time: TTFT(disaggregated) - TTFT(colocated), paired per prompt (median
  over the pairs), which holds the whole cost of disaggregation but also the run-to-run
  spread of the prefill compute itself;
- the same difference after taking each setup's server-reported prefill time out of its TTFT
  (`-prefill`), which leaves the compute spread out: transfer, control plane, first step;
- and after taking out the prefill engine's own model calls (`-engine`, the manifest's engine
  time, the colocated server's own): everything disaggregation adds, prefill's side included
  (the job's hop, queueing, digests, the pin, the manifest's hop), without the compute's spread;
- decode's READ time (first READ posted -> last done), its share of TTFT, and the bytes moved
  by section (attention K/V, conv, SSM), as the decode service reports them;
- whether both setups generated the same tokens.

Pipelined transfer (`--prefill-chunk-tokens N`, issue 16): prefill and colocated prefill in
chunks of N, and a third setup runs in the same loop, `unpipelined`: a second decode service on
the same prefill that takes one manifest after the whole prompt (--manifest-parts off), while
`disaggregated` READs each part as prefill computes on. Per length, the exposed transfer time
of both, and the share pipelining hides: 1 - exposed(pipelined) / exposed(unpipelined), from
the medians, on the paired TTFT difference and on the `-prefill` and `-engine` ones.

An engine that really computes is needed (prefill time must grow with the prompt): the hf
engine on a tiny checkpoint (the default: prefill of a 32k prompt takes ~15 s on two cores) or
the reference engine (tiny presets; a 2k prompt takes ~10 s, superlinear, so keep it under 4k).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from hybridpd_tools.bench.client import Timed, generate, seconds
from hybridpd_tools.bench.progress import Progress
from hybridpd_tools.bench.setups import PIPELINE_SETUPS, SETUPS, SetupConfig, flat_config, model_spec, start_setups
from hybridpd_tools.bench.stats import Summary, fixed, json_number, megabytes, ms_summary, ratio
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc

SCHEMA = "hybrid-pd.bench.e2e.long-prompt/v1"
DEFAULT_PROMPT_LENGTHS = (8192, 16384, 32768)


@dataclass(frozen=True)
class LongPromptConfig:
    setup: SetupConfig  # prefill_chunk_tokens > 0: pipelined transfer, with the unpipelined setup alongside
    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS
    requests_per_length: int = 2  # per setup
    max_tokens: int = 8
    warmup: int = 1  # unmeasured requests per setup first, at the shortest length
    seed: int = 0

    @property
    def setups(self) -> tuple[str, ...]:
        return PIPELINE_SETUPS if self.setup.prefill_chunk_tokens else SETUPS


@dataclass
class Sample:
    """One prompt, generated on both setups."""

    prompt_tokens: int
    results: dict[str, Timed] = field(default_factory=dict)


def _prompt(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab, n)]


async def run_long_prompt(cfg: LongPromptConfig, *, command: str, show_progress: bool = True) -> dict[str, Any]:
    spec = model_spec(cfg.setup.model, cfg.setup.engine)
    rng = np.random.default_rng(cfg.seed)
    setups = cfg.setups
    total = len(setups) * (cfg.warmup + cfg.requests_per_length * len(cfg.prompt_lengths))
    progress = Progress("bench e2e long-prompt", total, enabled=show_progress)
    progress.advance(0, "starting services")
    samples: list[Sample] = []
    try:
        async with start_setups(
            spec,
            cfg.setup,
            prompt_tokens=max(cfg.prompt_lengths),
            max_tokens=cfg.max_tokens,
            name="bench-long-prompt",
        ) as running:
            channels = {s: grpc.aio.insecure_channel(a) for s, a in running.addresses.items()}
            stubs = {s: pb_grpc.DecodeServiceStub(c) for s, c in channels.items()}
            try:
                for _ in range(cfg.warmup):  # lazy initialisation and wire-up: not measured
                    prompt = _prompt(rng, spec.vocab_size, min(cfg.prompt_lengths))
                    for setup in setups:
                        await generate(stubs[setup], prompt, cfg.max_tokens, ignore_eos=True)
                        progress.advance(1, f"warmup {setup}")
                for n in cfg.prompt_lengths:
                    for i in range(cfg.requests_per_length):
                        prompt = _prompt(rng, spec.vocab_size, n)
                        sample = Sample(n)
                        for setup in setups if i % 2 == 0 else setups[::-1]:
                            sample.results[setup] = await generate(stubs[setup], prompt, cfg.max_tokens, ignore_eos=True)
                            progress.advance(1, f"{n} tokens {setup}")
                        samples.append(sample)
            finally:
                for channel in channels.values():
                    await channel.close()
    finally:
        progress.finish()
    return build_long_prompt_result(cfg, samples, command)


def _minus_prefill(t: Timed) -> float:
    return t.ttft - seconds(t.summary.prefill_duration) if t.summary is not None else math.nan


def _minus_engine(t: Timed) -> float:
    """TTFT minus the prefill engine's own time (NaN where the server reports none)."""
    engine = seconds(t.summary.prefill_engine_duration) if t.summary is not None else 0.0
    return t.ttft - engine if engine > 0 else math.nan


def _minus_engines(t: Timed) -> float:
    """TTFT minus both engines' own time before the first token: prefill's model calls and, at the
    n-1 boundary, decode's first step (NaN where the prefill engine's time is not reported)."""
    first_step = seconds(t.summary.first_step_engine_duration) if t.summary is not None else 0.0
    return _minus_engine(t) - first_step


def _where(ts: Sequence[Timed]) -> dict[str, Any]:
    """Where a setup's TTFT beyond the prefill engine goes (medians over its requests): prefill's
    digests, the rest of prefill's time (queueing, the parts' and the manifest's work on its
    loop), and after prefill's time decode's state wait (READ + check), decode's first step
    and the rest (the hops, streaming)."""
    pairs = [(t.ttft, t.summary) for t in ts if t.summary is not None]
    done = [s for _, s in pairs]
    prefill = [seconds(s.prefill_duration) for s in done]
    digest = [seconds(s.prefill_digest_duration) for s in done]
    engine = [seconds(s.prefill_engine_duration) for s in done]
    after = [ttft - p for (ttft, _), p in zip(pairs, prefill)]
    state = [seconds(s.read_duration) + seconds(s.digest_check_duration) for s in done]
    first_step = [seconds(s.first_step_engine_duration) for s in done]
    return {
        "prefill_digest_ms": ms_summary(digest),
        "prefill_other_ms": ms_summary([p - d - e for p, d, e in zip(prefill, digest, engine) if e > 0]),
        "state_ms": ms_summary(state),
        "decode_first_step_ms": ms_summary(first_step),
        "after_prefill_other_ms": ms_summary([a - w - f for a, w, f in zip(after, state, first_step)]),
    }


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def _hidden(pipelined: Summary, unpipelined: Summary) -> float:
    """The share of the unpipelined exposed time that pipelining hides (NaN: nothing exposed)."""
    if not unpipelined.median > 0:
        return math.nan
    return 1.0 - pipelined.median / unpipelined.median


def length_row(n: int, samples: Sequence[Sample], setups: Sequence[str] = SETUPS) -> dict[str, Any]:
    """The figures of one prompt length, from its samples."""
    errors = [t.error for s in samples for t in s.results.values() if t.error]
    ok = [s for s in samples if all(not t.error for t in s.results.values()) and len(s.results) == len(setups)]
    d = [s.results["disaggregated"] for s in ok]
    c = [s.results["colocated"] for s in ok]
    summaries = [t.summary for t in d if t.summary is not None]
    first = summaries[0] if summaries else None
    exposed = [a.ttft - b.ttft for a, b in zip(d, c)]
    exposed_minus_prefill = [_minus_prefill(a) - _minus_prefill(b) for a, b in zip(d, c)]
    exposed_minus_engine = [_minus_engine(a) - _minus_engine(b) for a, b in zip(d, c)]
    read = [seconds(s.read_duration) for s in summaries]
    d_ttft = Summary.of([t.ttft for t in d]).median
    return {
        "prompt_tokens": n,
        "requests": len(samples),
        "errors": errors[:5],
        "ttft_ms": {"disaggregated": ms_summary([t.ttft for t in d]), "colocated": ms_summary([t.ttft for t in c])},
        "prefill_ms": {
            "disaggregated": ms_summary([seconds(t.summary.prefill_duration) for t in d if t.summary is not None]),
            "colocated": ms_summary([seconds(t.summary.prefill_duration) for t in c if t.summary is not None]),
        },
        "ttft_ratio": json_number(ratio(d_ttft, Summary.of([t.ttft for t in c]).median)),
        # Paired per prompt: disaggregated minus colocated.
        "exposed_transfer_ms": ms_summary(exposed),
        "exposed_minus_prefill_ms": ms_summary(exposed_minus_prefill),
        "exposed_minus_engine_ms": ms_summary(_finite(exposed_minus_engine)),
        "read_ms": ms_summary(read),
        "read_share_of_ttft": Summary.of([r / t.ttft for r, t in zip(read, d) if t.ttft > 0]).as_dict(6),
        # The digests of the state (--verify-transfer digest, the default): prefill takes them
        # before its manifest (inside prefill_ms), decode checks them before its first step.
        "prefill_digest_ms": ms_summary([seconds(s.prefill_digest_duration) for s in summaries]),
        "digest_check_ms": ms_summary([seconds(s.digest_check_duration) for s in summaries]),
        "transferred_tokens": first.num_transferred_tokens if first else None,
        "bytes": {
            "attention": first.transfer.attention_bytes if first else None,
            "conv": first.transfer.conv_bytes if first else None,
            "ssm": first.transfer.ssm_bytes if first else None,
            "total": first.transfer.total_bytes if first else None,
        },
        "reads": first.transfer.read_count if first else None,
        "descriptors": first.transfer.descriptor_count if first else None,
        "tokens_match": f"{sum(a.token_ids == b.token_ids for a, b in zip(d, c))}/{len(samples)}",
    } | (
        _unpipelined(ok, d, c, exposed, exposed_minus_prefill, exposed_minus_engine, len(samples))
        if "unpipelined" in setups
        else {}
    )


def _state_exposed(t: Timed) -> float:
    """What decode waited for the state after its (last) manifest: READ and digest check."""
    s = t.summary
    return seconds(s.read_duration) + seconds(s.digest_check_duration) if s is not None else math.nan


def _unpipelined(
    ok: Sequence[Sample],
    d: Sequence[Timed],
    c: Sequence[Timed],
    exposed: Sequence[float],
    exposed_minus_prefill: Sequence[float],
    exposed_minus_engine: Sequence[float],
    count: int,
) -> dict[str, Any]:
    """The unpipelined setup's figures, and the share of its exposed time pipelining hides."""
    u = [s.results["unpipelined"] for s in ok]
    u_exposed = [a.ttft - b.ttft for a, b in zip(u, c)]
    u_minus_prefill = [_minus_prefill(a) - _minus_prefill(b) for a, b in zip(u, c)]
    u_minus_engine = [_minus_engine(a) - _minus_engine(b) for a, b in zip(u, c)]
    d_minus_engines = _finite([_minus_engines(a) - _minus_engines(b) for a, b in zip(d, c)])
    u_minus_engines = _finite([_minus_engines(a) - _minus_engines(b) for a, b in zip(u, c)])
    u_summaries = [t.summary for t in u if t.summary is not None]
    d_summaries = [t.summary for t in d if t.summary is not None]
    return {
        "unpipelined_ttft_ms": ms_summary([t.ttft for t in u]),
        "unpipelined_exposed_transfer_ms": ms_summary(u_exposed),
        "unpipelined_exposed_minus_prefill_ms": ms_summary(u_minus_prefill),
        "unpipelined_exposed_minus_engine_ms": ms_summary(_finite(u_minus_engine)),
        "unpipelined_read_ms": ms_summary([seconds(s.read_duration) for s in u_summaries]),
        "unpipelined_digest_check_ms": ms_summary([seconds(s.digest_check_duration) for s in u_summaries]),
        "reads_pipelined": d_summaries[0].transfer.read_count if d_summaries else None,
        # Decode-reported, free of the prefill compute's spread: READ + digest check after the last manifest.
        "state_exposed_ms": ms_summary([_state_exposed(t) for t in d]),
        "unpipelined_state_exposed_ms": ms_summary([_state_exposed(t) for t in u]),
        "hidden_share_state": json_number(
            _hidden(Summary.of(_finite([_state_exposed(t) for t in d])), Summary.of(_finite([_state_exposed(t) for t in u])))
        ),
        "hidden_share": json_number(_hidden(Summary.of(exposed), Summary.of(u_exposed))),
        "hidden_share_minus_prefill": json_number(
            _hidden(Summary.of(_finite(exposed_minus_prefill)), Summary.of(_finite(u_minus_prefill)))
        ),
        "hidden_share_minus_engine": json_number(
            _hidden(Summary.of(_finite(exposed_minus_engine)), Summary.of(_finite(u_minus_engine)))
        ),
        # Both engines' compute taken out (prefill's and decode's first step): what each setup adds.
        "exposed_minus_engines_ms": ms_summary(d_minus_engines),
        "unpipelined_exposed_minus_engines_ms": ms_summary(u_minus_engines),
        "hidden_share_minus_engines": json_number(_hidden(Summary.of(d_minus_engines), Summary.of(u_minus_engines))),
        "unpipelined_tokens_match": f"{sum(a.token_ids == b.token_ids for a, b in zip(u, c))}/{count}",
        "where_ms": {"pipelined": _where(d), "unpipelined": _where(u)},
    }


def build_long_prompt_result(cfg: LongPromptConfig, samples: Sequence[Sample], command: str) -> dict[str, Any]:
    rows = [length_row(n, [s for s in samples if s.prompt_tokens == n], cfg.setups) for n in cfg.prompt_lengths]
    return {
        "schema": SCHEMA,
        "command": command,
        "config": flat_config(cfg) | {"prompt_lengths": list(cfg.prompt_lengths)},
        "lengths": rows,
    }


def format_long_prompt(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"bench e2e --workload long-prompt: {c['model']} ({c['engine']} engine), prefill TP {c['prefill_tp']} -> "
        f"decode TP {c['decode_tp']}, {c['requests_per_length']} prompts per length, {c['max_tokens']} new tokens each",
        "",
        f"{'prompt':>7} {'TTFT d ms':>10} {'TTFT c ms':>10} {'d/c':>6} {'exposed ms':>11} {'-prefill':>9} {'-engine':>8} "
        f"{'READ ms':>8} {'READ/TTFT':>10} {'digest ms':>9} {'FA MB':>8} {'conv MB':>8} {'SSM MB':>8} {'same':>5}",
    ]
    for r in result["lengths"]:
        share = r["read_share_of_ttft"]["median"]
        b = r["bytes"]
        lines.append(
            f"{r['prompt_tokens']:>7} {fixed(r['ttft_ms']['disaggregated']['median'], 1):>10} "
            f"{fixed(r['ttft_ms']['colocated']['median'], 1):>10} {fixed(r['ttft_ratio'], 3):>6} "
            f"{fixed(r['exposed_transfer_ms']['median'], 1):>11} {fixed(r['exposed_minus_prefill_ms']['median'], 1):>9} "
            f"{fixed(r.get('exposed_minus_engine_ms', {}).get('median'), 1):>8} "
            f"{fixed(r['read_ms']['median'], 2):>8} {fixed(None if share is None else 100 * share, 3) + ' %':>10} "
            f"{fixed(r['digest_check_ms']['median'], 2):>9} "
            f"{megabytes(b['attention']):>8} {megabytes(b['conv']):>8} {megabytes(b['ssm']):>8} {r['tokens_match']:>5}"
            + (f"  errors: {r['errors']}" if r["errors"] else "")
        )
    if c.get("prefill_chunk_tokens"):
        lines += _pipelining_table(result)
    lines += [
        "",
        "exposed: TTFT disaggregated - colocated, paired per prompt (median); it carries the run-to-run spread of",
        "the prefill compute too. -prefill: the same difference with each side's server-reported prefill time",
        "taken out of its TTFT (transfer, control plane, first decode step). -engine: with the prefill engine's own",
        "model calls taken out instead (all disaggregation adds, prefill's side too). READ: decode's first READ posted ->",
        "last READ done. digest: decode checking the state's digests before its first step (prefill's own digest",
        "time is inside its prefill time).",
    ]
    return "\n".join(lines)


def _pipelining_table(result: dict[str, Any]) -> list[str]:
    c = result["config"]
    lines = [
        "",
        f"pipelined transfer, prefill chunks of {c['prefill_chunk_tokens']} tokens"
        + (f", parts of at least {c['manifest_part_tokens']}" if c.get("manifest_part_tokens") else "")
        + (f", the last chunk in {c['layer_parts']} layer parts" if c.get("layer_parts") else "")
        + " (disaggregated: manifest parts READ while prefill computes; unpipelined: one manifest at the end, same prefill):",
        f"{'prompt':>7} {'parts':>5} {'exposed pipe':>12} {'exposed unpipe':>14} {'hidden':>7} "
        f"{'-prefill pipe':>13} {'-prefill unpipe':>15} {'hidden':>7} {'-engine pipe':>12} {'-engine unpipe':>14} "
        f"{'hidden':>7} {'state pipe':>10} {'state unpipe':>12} {'hidden':>7} {'same':>5}",
    ]
    for r in result["lengths"]:
        share, share_mp = r.get("hidden_share"), r.get("hidden_share_minus_prefill")
        lines.append(
            f"{r['prompt_tokens']:>7} {r.get('reads_pipelined') or '-':>5} {fixed(r['exposed_transfer_ms']['median'], 1):>12} "
            f"{fixed(r['unpipelined_exposed_transfer_ms']['median'], 1):>14} "
            f"{_percent(share):>7} "
            f"{fixed(r['exposed_minus_prefill_ms']['median'], 1):>13} {fixed(r['unpipelined_exposed_minus_prefill_ms']['median'], 1):>15} "
            f"{_percent(share_mp):>7} "
            f"{fixed(r.get('exposed_minus_engine_ms', {}).get('median'), 1):>12} "
            f"{fixed(r.get('unpipelined_exposed_minus_engine_ms', {}).get('median'), 1):>14} "
            f"{_percent(r.get('hidden_share_minus_engine')):>7} "
            f"{fixed(r['state_exposed_ms']['median'], 2):>10} {fixed(r['unpipelined_state_exposed_ms']['median'], 2):>12} "
            f"{_percent(r.get('hidden_share_state')):>7} {r['unpipelined_tokens_match']:>5}"
        )
    lines += ["", "where TTFT beyond the prefill engine goes, medians in ms (pipelined / unpipelined):"]
    lines.append(
        f"{'prompt':>7} {'prefill digests':>17} {'prefill other':>15} {'decode state':>15} {'decode first step':>19} "
        f"{'after prefill, other':>21} {'-engines pipe / unpipe (hidden)':>32}"
    )
    for r in result["lengths"]:
        p, u = r["where_ms"]["pipelined"], r["where_ms"]["unpipelined"]
        cells = [
            f"{fixed(p[k]['median'], 1)} / {fixed(u[k]['median'], 1)}"
            for k in ("prefill_digest_ms", "prefill_other_ms", "state_ms", "decode_first_step_ms", "after_prefill_other_ms")
        ]
        engines = (
            f"{fixed(r['exposed_minus_engines_ms']['median'], 1)} / {fixed(r['unpipelined_exposed_minus_engines_ms']['median'], 1)}"
            f" ({_percent(r.get('hidden_share_minus_engines'))})"
        )
        lines.append(
            f"{r['prompt_tokens']:>7} {cells[0]:>17} {cells[1]:>15} {cells[2]:>15} {cells[3]:>19} {cells[4]:>21} {engines:>32}"
        )
    lines += [
        "prefill other: prefill's time beyond its engine and digests (queueing, the parts' and the manifest's work);",
        "decode first step: decode's engine starting from the state and computing the first token (n-1 boundary);",
        "after prefill, other: TTFT after prefill's time beyond those (the hops, streaming). -engines: TTFT minus both",
        "engines' model calls before the first token, paired against colocated (its own taken out too).",
        "parts: READs of the pipelined request (one per part and rank pair); hidden: 1 - pipe / unpipe, medians; state: READ +",
        "digest check after the (last) manifest, as decode reports them (not touched by the prefill compute's spread). At the",
        "full-N boundary the first token leaves before the READ, so TTFT holds no transfer in either setup (use --boundary n-1).",
    ]
    return lines


def _percent(share: float | None) -> str:
    return fixed(None if share is None else 100 * share, 1) + " %"
