"""The `bench e2e` result from recorded timings: per-level figures, ratios, token equality."""

from __future__ import annotations

import json

import pytest

from hybridpd_tools.bench.client import Timed
from hybridpd_tools.bench.e2e import SCHEMA, E2EConfig, LevelResult, build_e2e_result, e2e_charts, format_e2e
from hybridpd_tools.bench.setups import SetupConfig

pytestmark = pytest.mark.timeout(30)


def timed(sent: float, first: float, last: float, tokens: list[int], after: float = 0.0) -> Timed:
    return Timed(sent=sent, token_ids=tokens, first_token=first, last_token=last, done=last + after)


CROSSOVER = {
    "prompt_tokens": [16, 32], "fa_bytes": [1, 2], "conv_bytes": [1, 1], "ssm_bytes": [2, 2], "total_bytes": [4, 5],
    "crossover_tokens": None, "crossover_estimate_tokens": None,
}  # fmt: skip


def test_ratios_and_token_equality() -> None:
    cfg = E2EConfig(concurrency=(1,), max_tokens=3)
    first, second = timed(0.0, 0.22, 0.42, [1, 2, 3], after=0.004), timed(1.0, 1.22, 1.42, [4, 5, 6], after=0.006)
    disagg = LevelResult("disaggregated", 1, [first, second], 2.0, 1.0)
    coloc = LevelResult("colocated", 1, [timed(0.0, 0.2, 0.4, [1, 2, 3]), timed(1.0, 1.2, 1.4, [4, 5, 7])], 1.5, 1.5)
    r = build_e2e_result(cfg, [disagg, coloc], CROSSOVER, "hybrid-pd bench e2e")
    assert r["schema"] == SCHEMA
    d, c = r["levels"]
    assert d["ttft_ms"]["median"] == 220.0 and c["ttft_ms"]["median"] == 200.0
    assert d["itl_ms"]["median"] == 100.0  # (0.42 - 0.22) / 2 gaps
    assert d["after_last_token_ms"]["median"] == pytest.approx(5.0) and c["after_last_token_ms"]["median"] == 0.0
    assert d["tokens_per_s"] == 3.0 and d["cpu_cores_used"] == 0.5 and d["tokens_per_s_per_core"] == 6.0
    cmp = r["comparisons"][0]
    assert cmp["ttft_ratio"] == 1.1 and cmp["tokens_per_s_ratio"] == 0.75
    assert cmp["tokens_match"] == "1/2"  # the second request's tokens differ
    assert r["target"]["met"] is True and r["target"]["value"] == 1.1
    json.dumps(r)
    text = format_e2e(r)
    assert "disaggregated" in text and "1/2" in text
    assert "disaggregated at concurrency 1: the stream ends 5.00 ms after the last token (p50)" in text
    assert [tag for tag, _ in e2e_charts(r)] == ["throughput", "ttft", "itl", "crossover"]


def test_the_ttft_target_follows_the_boundary() -> None:
    disagg = LevelResult("disaggregated", 1, [timed(0.0, 0.205, 0.4, [1, 2])], 1.0, 1.0)
    coloc = LevelResult("colocated", 1, [timed(0.0, 0.2, 0.4, [1, 2])], 1.0, 1.0)  # TTFT d/c = 1.025
    reference = build_e2e_result(E2EConfig(concurrency=(1,)), [disagg, coloc], CROSSOVER, "")
    hf = build_e2e_result(E2EConfig(SetupConfig("tiny-mamba2", "hf"), concurrency=(1,)), [disagg, coloc], CROSSOVER, "")
    hf_n_minus_1 = build_e2e_result(
        E2EConfig(SetupConfig("tiny-mamba2", "hf", boundary="n-1"), concurrency=(1,)), [disagg, coloc], CROSSOVER, ""
    )
    assert (reference["target"]["boundary"], reference["target"]["ttft_ratio_at_most"], reference["target"]["met"]) == (
        "n-1",
        1.10,
        True,
    )
    assert (hf["target"]["boundary"], hf["target"]["ttft_ratio_at_most"], hf["target"]["met"]) == ("full", 1.02, False)
    assert hf_n_minus_1["target"]["met"] is True
    assert "target at the full boundary <= 1.02: missed" in format_e2e(hf)


def test_failed_requests_are_reported_not_counted() -> None:
    bad = Timed(sent=0.0, error="UNAVAILABLE: no prefill")
    level = LevelResult("disaggregated", 2, [bad, timed(0.0, 0.1, 0.3, [1, 2, 3])], 1.0, None)
    row = level.as_dict()
    assert row["errors"] == ["UNAVAILABLE: no prefill"]
    assert row["tokens"] == 3 and row["ttft_ms"]["count"] == 1
    assert row["cpu_cores_used"] is None and row["tokens_per_s_per_core"] is None


def test_levels_are_cut_into_alternating_parts() -> None:
    from hybridpd_tools.bench.e2e import _parts

    assert [list(r) for r in _parts(6, 2)] == [[0, 1, 2], [3, 4, 5]]
    assert [len(r) for r in _parts(3, 10)] == [1, 1, 1]  # never an empty part
    assert sum(len(r) for r in _parts(17, 4)) == 17
    level = LevelResult("colocated", 1, [timed(0.0, 0.1, 0.3, [1, 2, 3])], 1.0, 0.5)
    level.add(LevelResult("colocated", 1, [timed(0.0, 0.1, 0.3, [4, 5, 6])], 2.0, None))
    assert len(level.timings) == 2 and level.wall == 3.0 and level.cpu_seconds is None


def _with_engine(t: Timed, engine_s: float) -> Timed:
    from shared.pb.hybridpd.v1 import decode_service_pb2 as pb

    summary = pb.GenerateSummary()
    summary.prefill_engine_duration.FromNanoseconds(round(engine_s * 1e9))
    t.summary = summary
    return t


def test_the_compute_matched_ratio_cancels_the_engines_spread() -> None:
    # Disaggregated adds 2 ms to its engine time, colocated 1 ms; but disaggregated's engine ran
    # 30 ms slower (another tenant's load): the plain ratio says 1.31, the matched one 1.01.
    disagg = [_with_engine(timed(0.0, 0.132, 0.2, [1, 2]), 0.130)]
    coloc = [_with_engine(timed(0.0, 0.101, 0.2, [1, 2]), 0.100)]
    levels = [LevelResult("disaggregated", 1, disagg, 1.0, 1.0), LevelResult("colocated", 1, coloc, 1.0, 1.0)]
    r = build_e2e_result(E2EConfig(SetupConfig("tiny-mamba2", "hf"), concurrency=(1,)), levels, CROSSOVER, "")
    d, c = r["levels"]
    assert d["engine_prefill_ms"]["median"] == pytest.approx(130.0) and d["ttft_minus_engine_ms"]["median"] == pytest.approx(2.0)
    assert c["ttft_minus_engine_ms"]["median"] == pytest.approx(1.0)
    cmp = r["comparisons"][0]
    assert cmp["ttft_ratio"] == pytest.approx(132 / 101, abs=1e-3)
    assert cmp["ttft_ratio_compute_matched"] == pytest.approx(102 / 101, abs=1e-3)
    assert cmp["engine_prefill_ratio"] == pytest.approx(1.3)
    assert r["target"]["met"] is False and r["target"]["compute_matched_met"] is True
    assert "compute-matched 1.010 (met)" in format_e2e(r)


def test_without_engine_times_there_is_no_matched_ratio() -> None:
    disagg = LevelResult("disaggregated", 1, [timed(0.0, 0.2, 0.4, [1, 2])], 1.0, 1.0)
    coloc = LevelResult("colocated", 1, [timed(0.0, 0.2, 0.4, [1, 2])], 1.0, 1.0)
    r = build_e2e_result(E2EConfig(concurrency=(1,)), [disagg, coloc], CROSSOVER, "")
    assert r["comparisons"][0]["ttft_ratio_compute_matched"] is None and r["target"]["compute_matched_met"] is False
    assert "compute-matched - (missed)" in format_e2e(r)
