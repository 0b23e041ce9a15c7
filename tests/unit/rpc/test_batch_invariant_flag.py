"""--batch-invariant (both services): on by default, off from the flag or the environment; it
reaches the paged engine's factory, and start-up says when it is off (and when the engine
ignores it)."""

from __future__ import annotations

import logging

import pytest

from shared.config import Role, build_parser, parse_settings
from shared.runtime.engine_host import engine_line


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_on_by_default_and_off_by_flag_or_env(role: Role, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_settings(role, [], environ={}).batch_invariant is True
    assert parse_settings(role, ["--batch-invariant", "off"], environ={}).batch_invariant is False
    assert parse_settings(role, [], environ={"HYBRID_PD_BATCH_INVARIANT": "false"}).batch_invariant is False
    with pytest.raises(SystemExit):
        parse_settings(role, ["--batch-invariant", "sometimes"], environ={})
    assert "--batch-invariant = 'sometimes'" in capsys.readouterr().err


def test_help_states_the_trade_and_who_ignores_it() -> None:
    text = " ".join(build_parser("decode").format_help().split())
    assert "one GEMM over the whole batch" in text and "bits depend on the batch" in text
    assert "Engines that do not batch (reference, synthetic, hf) ignore it" in text


def test_start_up_line_says_when_it_is_off() -> None:
    def line(*argv: str) -> str:
        level, text = engine_line(parse_settings("decode", list(argv), environ={}), "m")
        assert level == logging.INFO
        return text

    assert "batch invariance" not in line("--engine", "paged", "--model", "ckpt")
    off = line("--engine", "paged", "--model", "ckpt", "--batch-invariant", "off")
    assert off.startswith("engine paged: checkpoint ckpt; batch invariance off: one GEMM over each step's batch")
    assert line("--engine", "hf", "--model", "ckpt", "--batch-invariant", "off").endswith(
        "--batch-invariant off is ignored: the hf engine does not batch"
    )
    assert "is ignored: the reference engine" in line("--batch-invariant", "off")
