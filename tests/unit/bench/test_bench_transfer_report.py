"""The `bench transfer` result: required JSON keys, ratios from the same run, target verdicts."""

from __future__ import annotations

import json

import pytest

from hybridpd_tools.bench.sections import SectionBytes
from hybridpd_tools.bench.transfer_report import SCHEMA, TransferSamples, build_result, chart_rows, format_table

pytestmark = pytest.mark.timeout(30)

REQUIRED = (
    "gbps", "raw_nixl_gbps", "raw_nixl_coalesced_gbps", "memcpy_gbps",
    "ratio_vs_raw_nixl", "ratio_vs_memcpy", "bytes", "descriptors",
)  # fmt: skip

CONFIG = {"model": "m", "prefill_tp": 1, "decode_tp": 2, "prompt_tokens": 9, "transferred_tokens": 8, "requests": 3, "warmup": 1}


def result(samples: TransferSamples, matches: bool = True) -> dict[str, object]:
    return build_result(
        config=CONFIG,
        sections=SectionBytes(fa=600_000_000, conv=100_000_000, ssm=300_000_000),
        descriptors={"ours": 100, "raw_nixl": 100, "raw_nixl_coalesced": 4},
        reads=2,
        samples=samples,
        descriptor_set_matches=matches,
        command="hybrid-pd bench transfer",
    )


def test_keys_rates_and_ratios() -> None:
    # 1 GB per request: ours 0.5 s, raw 0.4 s, coalesced 0.25 s, memcpy 0.1 s (medians)
    r = result(TransferSamples(ours=[0.4, 0.5, 0.6], raw_nixl=[0.4, 0.4, 0.9], raw_nixl_coalesced=[0.25] * 3, memcpy=[0.1] * 3))
    for key in REQUIRED:
        assert key in r, key
    assert r["schema"] == SCHEMA
    assert r["bytes"] == {"fa": 600_000_000, "conv": 100_000_000, "ssm": 300_000_000, "total": 1_000_000_000}
    assert (r["gbps"], r["raw_nixl_gbps"], r["raw_nixl_coalesced_gbps"], r["memcpy_gbps"]) == (2.0, 2.5, 4.0, 10.0)
    assert (r["ratio_vs_raw_nixl"], r["ratio_vs_raw_nixl_coalesced"], r["ratio_vs_memcpy"]) == (0.8, 0.5, 0.2)
    assert r["raw_nixl_vs_memcpy"] == 0.25
    # per round: raw/ours = 1.0, 0.8, 1.5 -> median 1.0; memcpy/ours = 0.25, 0.2, 0.1667 -> 0.2
    assert r["ratio_vs_raw_nixl_paired"] == 1.0 and r["ratio_vs_memcpy_paired"] == 0.2
    targets = r["targets"]
    assert isinstance(targets, dict)
    assert targets["ratio_vs_raw_nixl"]["met"] is False  # 0.8 < 0.95
    json.dumps(r)  # plain JSON: no nan, no numpy types


def test_target_met_and_missing_baseline() -> None:
    met = result(TransferSamples(ours=[0.5], raw_nixl=[0.5], raw_nixl_coalesced=[0.5], memcpy=[0.1]))
    assert met["targets"]["ratio_vs_raw_nixl"]["met"] is True  # type: ignore[index]
    assert met["targets"]["ratio_vs_raw_nixl_coalesced"]["met"] is True  # type: ignore[index]
    empty = result(TransferSamples(ours=[0.5]))
    assert empty["raw_nixl_gbps"] is None and empty["ratio_vs_raw_nixl"] is None
    assert empty["targets"]["ratio_vs_raw_nixl"]["met"] is False  # type: ignore[index]
    json.dumps(empty)


def test_table_names_every_method_and_warns_on_mismatch() -> None:
    samples = TransferSamples(ours=[0.5], raw_nixl=[0.4], raw_nixl_coalesced=[0.25], memcpy=[0.1], ttft=[1.0], prefill=[0.5])
    table = format_table(result(samples))  # type: ignore[arg-type]
    for text in ("(a) raw NIXL", "(b) raw NIXL", "(c) torch copy", "FA 600.00 MB", "missed"):
        assert text in table
    assert "WARNING" not in table
    assert "WARNING" in format_table(result(samples, matches=False))  # type: ignore[arg-type]
    labels, values = chart_rows(result(samples))  # type: ignore[arg-type]
    assert len(labels) == len(values) == 4


def test_digest_shares_are_per_request_against_that_requests_read() -> None:
    # READs 0.1, 0.2, 0.4 s; decode checks 0.004, 0.02, 0.02 s -> shares 0.04, 0.1, 0.05 -> median 0.05
    r = result(TransferSamples(ours=[0.1, 0.2, 0.4], digest_check=[0.004, 0.02, 0.02], prefill_digest=[0.01, 0.01, 0.01]))
    assert r["digest_check_vs_read"] == 0.05 and r["prefill_digest_vs_read"] == 0.05
    assert r["targets"]["digest_check_vs_read"] == {"at_most": 0.05, "value": 0.05, "met": True}  # type: ignore[index]
    worse = result(TransferSamples(ours=[0.1], digest_check=[0.05]))
    assert worse["targets"]["digest_check_vs_read"]["met"] is False  # type: ignore[index]
    assert "digests: decode check" in format_table(r)
    json.dumps(result(TransferSamples(ours=[0.1])))  # no digest samples: still plain JSON


def test_the_hash_pass_floor_is_reported_per_request_against_that_requests_read() -> None:
    r = result(TransferSamples(ours=[0.1, 0.2, 0.4], hash_pass=[0.01, 0.06, 0.04]))  # shares 0.1, 0.3, 0.1
    assert r["hash_pass_vs_read"] == 0.1 and r["hash_pass_ms"]["median"] == 40.0  # type: ignore[index]
    assert "one xxh3-128 pass over the same bytes" in format_table(r) and "= 0.100 of the READ" in format_table(r)


def test_each_raw_method_counts_its_fastest_pumping_and_every_strategy_is_reported() -> None:
    samples = TransferSamples(ours=[0.5, 0.5, 0.5], memcpy=[0.1] * 3)
    # raw_nixl: spin median 2.0 s, sleep-1ms 0.4 s; coalesced: spin 0.25 s, sleep-1ms 1.0 s
    for spin, sleep in ((2.0, 0.4), (1.0, 0.4), (3.0, 0.5)):
        samples.add_raw("raw_nixl", "spin", spin)
        samples.add_raw("raw_nixl", "sleep-1ms", sleep)
    for spin, sleep in ((0.25, 1.0), (0.25, 1.0), (0.25, 1.0)):
        samples.add_raw("raw_nixl_coalesced", "spin", spin)
        samples.add_raw("raw_nixl_coalesced", "sleep-1ms", sleep)
    assert samples.take_fastest_pumping() == {"raw_nixl": "sleep-1ms", "raw_nixl_coalesced": "spin"}
    assert samples.raw_nixl == [0.4, 0.4, 0.5] and samples.raw_nixl_coalesced == [0.25] * 3
    r = result(samples)
    assert r["raw_nixl_gbps"] == 2.5 and r["raw_nixl_coalesced_gbps"] == 4.0  # the fastest strategies' medians
    assert r["raw_nixl_pumping"] == {
        "raw_nixl": {"chosen": "sleep-1ms", "gbps": {"spin": 0.5, "sleep-1ms": 2.5}},
        "raw_nixl_coalesced": {"chosen": "spin", "gbps": {"spin": 4.0, "sleep-1ms": 1.0}},
    }
    assert "(a) raw NIXL pumping, GB/s: spin 0.50, sleep-1ms 2.50; counted: sleep-1ms" in format_table(r)  # type: ignore[arg-type]
    json.dumps(r)


def test_moved_bytes_and_shares_of_a_shaped_link() -> None:
    samples = TransferSamples(ours=[0.5], raw_nixl=[0.4], raw_nixl_coalesced=[0.25], memcpy=[0.1])
    link = {"transport": "UCX tcp", "rate": "40gbit", "rate_gbps": 5.0, "delay": None, "qdisc": "tbf"}
    r = build_result(
        config=CONFIG | {"hosts": link},
        sections=SectionBytes(fa=600_000_000, conv=100_000_000, ssm=300_000_000),
        descriptors={"ours": 100, "raw_nixl": 100, "raw_nixl_coalesced": 4},
        reads=2,
        samples=samples,
        descriptor_set_matches=True,
        command="hybrid-pd bench transfer --hosts --link-rate 40gbit",
        moved_bytes={"raw_nixl": 1_000_000_000, "raw_nixl_coalesced": 1_000_000_000},
    )
    assert r["moved_bytes"] == {"ours": 1_000_000_000, "raw_nixl": 1_000_000_000, "raw_nixl_coalesced": 1_000_000_000}
    # 2.0, 2.5 and 4.0 GB/s over a 5 GB/s link
    assert r["vs_link_rate"] == {"ours": 0.4, "raw_nixl": 0.5, "raw_nixl_coalesced": 0.8}
    assert "link shaped to 40gbit = 5.000 GB/s (tbf): ours 0.40 of it, (a) 0.50, (b) 0.80" in format_table(r)
    unshaped = result(samples)
    assert "vs_link_rate" not in unshaped and "link" not in format_table(unshaped)  # type: ignore[arg-type]
