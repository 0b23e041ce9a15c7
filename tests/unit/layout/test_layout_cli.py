"""`hybrid-pd models` and `hybrid-pd plan`: output, JSON, exit codes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hybridpd_tools.cli import layout_cmds
from shared.layout.presets import PRESETS

pytestmark = pytest.mark.timeout(120)
DATA = Path(__file__).parent / "data"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybrid-pd")
    layout_cmds.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def test_models_lists_every_preset_with_valid_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["models"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    line = next(x for x in out.splitlines() if x.startswith("jamba-reasoning-3b"))
    assert "mamba1" in line and "20q/1kv x128" in line and line.endswith("1,2,4")
    assert run(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    valid = {r["name"]: r["valid_tp"] for r in rows}
    assert valid["granite-4.0-h-tiny"] == [1, 2, 4]
    assert valid["nemotron-3-nano-30b-a3b"] == [1, 2, 4, 8, 16]  # 8 groups, each on 2 ranks at 16
    assert valid["tiny-mamba2-g2"] == [1, 2, 4, 8]


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["plan", "--model", "nemotron-3-nano-30b-a3b", "--prefill-tp", "2", "--decode-tp", "4", "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "tp_ratio +2" in out
    assert "2096 (requested 16, raised to the minimum)" in out and "1056 (requested 16" in out
    assert sum(line.startswith("decode rank ") for line in out.splitlines()) == 4 and "verified" in out
    assert "per request of 1000 tokens" in out


def test_plan_with_groups_replicated_across_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """TP 16 with 8 SSM groups (refused before): each group on 2 decode ranks, verified."""
    assert run(["plan", "--model", "nemotron-3-nano-30b-a3b", "--prefill-tp", "8", "--decode-tp", "16"]) == 0
    out = capsys.readouterr().out
    assert "(512, 3) x:256 B:128 C:128 (B, C replicated on 2 ranks)" in out
    assert sum(line.startswith("decode rank ") for line in out.splitlines()) == 16 and "verified" in out
    assert run(["plan", "--model", "nemotron-3-nano-30b-a3b", "--prefill-tp", "16", "--decode-tp", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] and doc["prefill"]["section_dims"] == [256, 128, 128]
    assert [r["mamba_sources"] for r in doc["ranks"]][:2] == [[0, 1], [2, 3]]
    second = doc["ranks"][0]["reads"][1]
    assert second["conv"][1:] == [None, None]  # B and C come whole from the first source only


def test_plan_json_from_a_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    code = run(
        [
            "plan",
            "--model",
            str(DATA / "granitemoehybrid.json"),
            "--prefill-tp",
            "4",
            "--decode-tp",
            "2",
            "--kv-dtype",
            "fp8",
            "--decode-kernel-block-size",
            "16",
            "--json",
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "hybrid-pd.plan/v1" and doc["verified"] and doc["tp_ratio"] == -2
    assert doc["decode"]["kernel_block_size"] == 16 and doc["decode"]["fa_bytes_per_token"] == 2 * 2 * 128


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--model", "granite-4.0-h-tiny", "--prefill-tp", "2", "--decode-tp", "8"], "query heads 12"),
        (["--model", "nope", "--prefill-tp", "1", "--decode-tp", "1"], "neither a preset"),
        (["--model", "tiny-gdn", "--prefill-tp", "1"], "missing --decode-tp"),
        (
            [
                "--model",
                "tiny-gdn",
                "--prefill-tp",
                "1",
                "--decode-tp",
                "1",
                "--block-size",
                "100",
                "--decode-kernel-block-size",
                "16",
            ],
            "does not divide",
        ),
    ],
)
def test_plan_invalid_input_exits_2_with_one_line(argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert reason in captured.err and captured.err.count("\n") == 1


def test_plan_violations_exit_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Fake verifier: real plans never have violations, so the exit path needs an injected one.
    monkeypatch.setattr(layout_cmds, "verify_plan", lambda plan: ["fake violation"])
    assert run(["plan", "--model", "tiny-mamba2", "--prefill-tp", "1", "--decode-tp", "2"]) == 1
    assert "fake violation" in capsys.readouterr().out
    assert run(["plan", "--model", "tiny-mamba2", "--prefill-tp", "1", "--decode-tp", "2", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["violations"] == ["fake violation"]


def test_plan_sweep_lists_invalid_pairs(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["plan", "--all"]) == 0
    out = capsys.readouterr().out
    assert "nemotron-3-nano-30b-a3b  25/25" in out  # TP 16 included: 8 groups, each on 2 ranks
    assert "tiny-mamba2-g2           16/25" in out
    assert "jamba-reasoning-3b: TP 8 is invalid: query heads 20" in out
    assert "falcon-h1-7b: TP 8 is invalid: query heads 12" in out


def test_flags_from_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HYBRID_PD_MODEL", "tiny-mamba1")
    monkeypatch.setenv("HYBRID_PD_PREFILL_TP", "2")
    monkeypatch.setenv("HYBRID_PD_DECODE_TP", "1")
    assert run(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-mamba1"
