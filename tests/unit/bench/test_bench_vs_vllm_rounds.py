"""scripts/bench_vs_vllm.py's table over several rounds: medians of each figure, and each
ratio the median of the rounds' own ratios (the baseline of the same round), not a ratio of
medians."""

from __future__ import annotations

from typing import Any

from tests.unit.bench.test_bench_vs_vllm_cpu import bench_script


def _row(module: Any, setup: str, round_index: int, tok_s: float) -> Any:
    result = {
        "output_throughput": tok_s,
        "median_ttft_ms": 10.0,
        "p99_ttft_ms": 20.0,
        "median_tpot_ms": 5.0,
        "median_e2el_ms": 99.0,
    }
    return module.Row(setup, 8, result, round=round_index)


def _cells(text: str, setup: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {setup} "))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_ratios_are_medians_of_each_rounds_ratio() -> None:
    module = bench_script()
    # vLLM drifts 100 -> 400 -> 200 between rounds; ours is half of it in every round.
    rows = [
        _row(module, setup, i, tok_s)
        for i, (theirs, ours) in enumerate([(100.0, 50.0), (400.0, 200.0), (200.0, 100.0)])
        for setup, tok_s in (("vllm", theirs), ("ours", ours))
    ]
    text = module.table(rows)
    ours = _cells(text, "ours")
    assert ours[2] == "100"  # the median of 50, 200, 100
    assert ours[7] == "0.50"  # every round's ratio
    # The negative control: a ratio of the medians would agree here by chance, so pair the
    # rounds wrongly and see the ratio move.
    shuffled = [module.Row(r.setup, r.level, r.result, round=(r.round + 1) % 3 if r.setup == "ours" else r.round) for r in rows]
    assert _cells(module.table(shuffled), "ours")[7] != "0.50"


def test_raw_names_keep_one_round_runs_as_they_were() -> None:
    module = bench_script()
    assert module.raw_name("ours", 32, 0) == "ours-c32"
    assert module.raw_name("ours", 32, 2) == "ours-c32-r3"
