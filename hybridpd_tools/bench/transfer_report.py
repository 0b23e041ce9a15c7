"""The result of `bench transfer` as JSON (schema `hybrid-pd.bench.transfer/v1`) and as a table.

Pure: built from byte counts, descriptor counts and the seconds measured per round. Every
GB/s figure is bytes / median seconds; every ratio compares two figures of the same run. The
`*_paired` ratios are the median over rounds of (baseline seconds / our seconds) in the same
round: less sensitive to drift across the run than the ratio of medians.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridpd_tools.bench.sections import SectionBytes
from hybridpd_tools.bench.stats import Summary, gbps, json_number, median, ratio

SCHEMA = "hybrid-pd.bench.transfer/v1"
TARGET_VS_RAW_NIXL = 0.95
TARGET_VS_RAW_NIXL_COALESCED = 0.85
TARGET_DIGEST_SHARE = 0.05  # decode's digest check, as a share of the READ it follows

# key in `seconds` -> row label
METHODS: dict[str, str] = {
    "ours": "ours (services, GenerateSummary.read_duration)",
    "raw_nixl": "(a) raw NIXL, identical descriptors",
    "raw_nixl_coalesced": "(b) raw NIXL, one descriptor per region",
    "memcpy": "(c) torch copy, 1 thread, same bytes",
}


@dataclass
class TransferSamples:
    """Seconds per measured round, for each method (same rounds, interleaved)."""

    ours: list[float] = field(default_factory=list)
    raw_nixl: list[float] = field(default_factory=list)
    raw_nixl_coalesced: list[float] = field(default_factory=list)
    memcpy: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)
    digest_check: list[float] = field(default_factory=list)  # decode, after the READ
    prefill_digest: list[float] = field(default_factory=list)  # prefill, before the manifest
    hash_pass: list[float] = field(default_factory=list)  # one xxh3-128 pass over the same bytes
    # Raw seconds per round under each pumping strategy (raw_pumping.py), per raw method;
    # `take_fastest_pumping` makes raw_nixl and raw_nixl_coalesced the fastest strategy's.
    by_pumping: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def of(self, method: str) -> list[float]:
        values: list[float] = getattr(self, method)
        return values

    def add_raw(self, method: str, pumping: str, seconds: float) -> None:
        self.by_pumping.setdefault(method, {}).setdefault(pumping, []).append(seconds)

    def take_fastest_pumping(self) -> dict[str, str]:
        """Each raw method's samples become those of its strategy with the lowest median;
        returns method -> that strategy."""
        chosen: dict[str, str] = {}
        for method, runs in self.by_pumping.items():
            chosen[method] = fastest_pumping(runs)
            setattr(self, method, list(runs[chosen[method]]))
        return chosen


def fastest_pumping(runs: dict[str, list[float]]) -> str:
    """The pumping strategy whose median seconds are lowest (the first of equals)."""
    return min(runs, key=lambda name: Summary.of(runs[name]).median)


def paired_ratio(ours: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over rounds of baseline time / our time (= our GB/s over the baseline's, per round)."""
    return median([b / o for o, b in zip(ours, baseline) if o > 0])


def build_result(
    *,
    config: dict[str, Any],
    sections: SectionBytes,
    descriptors: dict[str, int],
    reads: int,
    samples: TransferSamples,
    descriptor_set_matches: bool,
    command: str,
    moved_bytes: dict[str, int] | None = None,
) -> dict[str, Any]:
    total = sections.total
    rates = {m: gbps(total, Summary.of(samples.of(m)).median) for m in METHODS}
    ours = rates["ours"]
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command,
        "config": config,
        "bytes": sections.as_dict(),
        "descriptors": descriptors,
        "reads": reads,
        "descriptor_set_matches": descriptor_set_matches,
        "gbps": json_number(ours),
        "raw_nixl_gbps": json_number(rates["raw_nixl"]),
        "raw_nixl_coalesced_gbps": json_number(rates["raw_nixl_coalesced"]),
        "memcpy_gbps": json_number(rates["memcpy"]),
        "ratio_vs_raw_nixl": json_number(ratio(ours, rates["raw_nixl"])),
        "ratio_vs_raw_nixl_coalesced": json_number(ratio(ours, rates["raw_nixl_coalesced"])),
        "ratio_vs_memcpy": json_number(ratio(ours, rates["memcpy"])),
        "raw_nixl_vs_memcpy": json_number(ratio(rates["raw_nixl"], rates["memcpy"])),
        "raw_nixl_coalesced_vs_memcpy": json_number(ratio(rates["raw_nixl_coalesced"], rates["memcpy"])),
        "ratio_vs_raw_nixl_paired": json_number(paired_ratio(samples.ours, samples.raw_nixl)),
        "ratio_vs_raw_nixl_coalesced_paired": json_number(paired_ratio(samples.ours, samples.raw_nixl_coalesced)),
        "ratio_vs_memcpy_paired": json_number(paired_ratio(samples.ours, samples.memcpy)),
        "seconds": {m: Summary.of(samples.of(m)).as_dict() for m in METHODS},
        "ttft_ms": Summary.of(samples.ttft).scaled(1e3).as_dict(),
        "prefill_ms": Summary.of(samples.prefill).scaled(1e3).as_dict(),
        "digest_check_ms": Summary.of(samples.digest_check).scaled(1e3).as_dict(),
        "prefill_digest_ms": Summary.of(samples.prefill_digest).scaled(1e3).as_dict(),
        # Median over requests of (digest seconds / the same request's READ seconds).
        "digest_check_vs_read": json_number(_share(samples.digest_check, samples.ours)),
        "prefill_digest_vs_read": json_number(_share(samples.prefill_digest, samples.ours)),
        # The floor of any digest of every byte here: one hash pass, as a share of the READ.
        "hash_pass_ms": Summary.of(samples.hash_pass).scaled(1e3).as_dict(),
        "hash_pass_vs_read": json_number(_share(samples.hash_pass, samples.ours)),
        "samples_seconds": {m: [json_number(s, 5) for s in samples.of(m)] for m in METHODS},
        # The bytes each method moved per request (the raw ones from their own descriptor lists).
        "moved_bytes": {"ours": total, **(moved_bytes or {})},
        "raw_nixl_pumping": {
            method: {
                "chosen": fastest_pumping(runs),
                "gbps": {name: json_number(gbps(total, Summary.of(v).median)) for name, v in runs.items()},
            }
            for method, runs in samples.by_pumping.items()
        },
    }
    link = config.get("hosts") or {}
    if link.get("rate_gbps"):
        # Shares of the shaped link's rate (tc counts whole frames: TCP payload tops out ~0.95).
        result["vs_link_rate"] = {
            "ours": json_number(ratio(ours, link["rate_gbps"])),
            "raw_nixl": json_number(ratio(rates["raw_nixl"], link["rate_gbps"])),
            "raw_nixl_coalesced": json_number(ratio(rates["raw_nixl_coalesced"], link["rate_gbps"])),
        }
    result["targets"] = {
        "ratio_vs_raw_nixl": _target(result["ratio_vs_raw_nixl"], TARGET_VS_RAW_NIXL),
        "ratio_vs_raw_nixl_coalesced": _target(result["ratio_vs_raw_nixl_coalesced"], TARGET_VS_RAW_NIXL_COALESCED),
        "digest_check_vs_read": _target_at_most(result["digest_check_vs_read"], TARGET_DIGEST_SHARE),
    }
    return result


def _share(part: Sequence[float], whole: Sequence[float]) -> float:
    return median([p / w for p, w in zip(part, whole) if w > 0]) if part else math.nan


def _target_at_most(value: float | None, at_most: float) -> dict[str, Any]:
    return {"at_most": at_most, "value": value, "met": value is not None and value <= at_most}


def _target(value: float | None, at_least: float) -> dict[str, Any]:
    return {"at_least": at_least, "value": value, "met": value is not None and value >= at_least}


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _num(value: Any, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    c, b, d = result["config"], result["bytes"], result["descriptors"]
    lines = [
        f"bench transfer: {c['model']}, prefill TP {c['prefill_tp']} -> decode TP {c['decode_tp']}, "
        f"prompt {c['prompt_tokens']} tokens ({c['transferred_tokens']} transferred), "
        f"{c['requests']} requests (+{c['warmup']} warm-up)",
        f"bytes per request: FA {_mb(b['fa'])}, conv {_mb(b['conv'])}, SSM {_mb(b['ssm'])}, total {_mb(b['total'])} "
        f"in {result['reads']} READ(s)",
        "",
        f"{'method':<48} {'descriptors':>11} {'median ms':>10} {'p99 ms':>8} {'GB/s':>7} {'ours/this':>10}",
    ]
    rates = {
        "ours": result["gbps"],
        "raw_nixl": result["raw_nixl_gbps"],
        "raw_nixl_coalesced": result["raw_nixl_coalesced_gbps"],
        "memcpy": result["memcpy_gbps"],
    }
    for method, label in METHODS.items():
        s = result["seconds"][method]
        rate = rates[method]
        mine = result["gbps"]
        rel = None if rate in (None, 0) or mine is None else mine / rate
        med = None if s["median"] is None else s["median"] * 1e3
        p99 = None if s["p99"] is None else s["p99"] * 1e3
        lines.append(
            f"{label:<48} {_num(d.get(method), 'd'):>11} {_num(med, '.2f'):>10} {_num(p99, '.2f'):>8} "
            f"{_num(rate, '.2f'):>7} {_num(rel, '.3f'):>10}"
        )
    t = result["targets"]
    lines += [
        "",
        f"ours / (a) = {_num(result['ratio_vs_raw_nixl'], '.3f')} (target >= {TARGET_VS_RAW_NIXL}: "
        f"{'met' if t['ratio_vs_raw_nixl']['met'] else 'missed'}); "
        f"ours / (b) = {_num(result['ratio_vs_raw_nixl_coalesced'], '.3f')} (target >= {TARGET_VS_RAW_NIXL_COALESCED}: "
        f"{'met' if t['ratio_vs_raw_nixl_coalesced']['met'] else 'missed'}); "
        f"ours / (c) = {_num(result['ratio_vs_memcpy'], '.3f')}; (a) / (c) = {_num(result['raw_nixl_vs_memcpy'], '.3f')}",
        f"paired per round (median of baseline time / our time): ours / (a) = {_num(result['ratio_vs_raw_nixl_paired'], '.3f')}, "
        f"ours / (b) = {_num(result['ratio_vs_raw_nixl_coalesced_paired'], '.3f')}, ours / (c) = {_num(result['ratio_vs_memcpy_paired'], '.3f')}",
        f"TTFT median {_num(result['ttft_ms']['median'], '.1f')} ms, prefill median {_num(result['prefill_ms']['median'], '.1f')} ms",
        f"digests: decode check {_num(result['digest_check_ms']['median'], '.2f')} ms = "
        f"{_num(result['digest_check_vs_read'], '.3f')} of the READ (target <= {TARGET_DIGEST_SHARE}: "
        f"{'met' if t['digest_check_vs_read']['met'] else 'missed'}); prefill taking them "
        f"{_num(result['prefill_digest_ms']['median'], '.2f')} ms = {_num(result['prefill_digest_vs_read'], '.3f')} of the READ",
        f"one xxh3-128 pass over the same bytes (the least a digest of every byte costs here): "
        f"{_num(result.get('hash_pass_ms', {}).get('median'), '.2f')} ms = {_num(result.get('hash_pass_vs_read'), '.3f')} of the READ",
    ]
    for method, pumping in result.get("raw_nixl_pumping", {}).items():
        by_name = ", ".join(f"{name} {_num(v, '.2f')}" for name, v in pumping["gbps"].items())
        lines.append(f"{METHODS[method].split(',')[0]} pumping, GB/s: {by_name}; counted: {pumping['chosen']}")
    if result.get("config", {}).get("hosts"):
        lines.append(_link_line(result))
    if not result["descriptor_set_matches"]:
        lines.append(
            "WARNING: the services' byte or descriptor counts differ from the rebuilt descriptor set; "
            "(a) and (b) may not move the same bytes"
        )
    return "\n".join(lines)


def _link_line(result: dict[str, Any]) -> str:
    link = result["config"]["hosts"]
    where = f"hosts apart, {link.get('transport', 'UCX tcp')}"
    if not link.get("rate"):
        return f"{where}, link not shaped"
    shares = result.get("vs_link_rate")
    delay = f", {link['delay']} one way" if link.get("delay") else ""
    if not shares:
        return f"{where}, link shaped to {link['rate']}{delay} ({link.get('qdisc')})"
    return (
        f"{where}, link shaped to {link['rate']} = {_num(link['rate_gbps'], '.3f')} GB/s{delay} ({link.get('qdisc')}): "
        f"ours {_num(shares['ours'], '.2f')} of it, (a) {_num(shares['raw_nixl'], '.2f')}, "
        f"(b) {_num(shares['raw_nixl_coalesced'], '.2f')}"
    )


def chart_rows(result: dict[str, Any]) -> tuple[Sequence[str], Sequence[float]]:
    """(labels, GB/s) for a bar chart."""
    labels = ["ours", "(a) raw NIXL", "(b) 1 desc/region", "(c) memcpy"]
    keys = ["gbps", "raw_nixl_gbps", "raw_nixl_coalesced_gbps", "memcpy_gbps"]
    return labels, [math.nan if result[k] is None else float(result[k]) for k in keys]
