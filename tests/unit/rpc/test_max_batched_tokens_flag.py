"""--max-batched-tokens (prefill and decode): without it the budget follows --device (a small one
on a CPU, where a step's prompts compute one after another; a large one on an accelerator); the
flag or the environment overrides either; a value below 1 is refused naming the flag."""

from __future__ import annotations

import pytest

from shared.config import Role, build_parser, parse_settings
from shared.config.flags import CPU_MAX_BATCHED_TOKENS, DEFAULT_MAX_BATCHED_TOKENS


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_default_follows_the_device(role: Role) -> None:
    assert CPU_MAX_BATCHED_TOKENS < DEFAULT_MAX_BATCHED_TOKENS
    assert parse_settings(role, [], environ={}).max_batched_tokens == CPU_MAX_BATCHED_TOKENS
    assert parse_settings(role, ["--device", "cpu"], environ={}).max_batched_tokens == CPU_MAX_BATCHED_TOKENS
    cuda = parse_settings(role, ["--device", "cuda"], environ={})
    assert cuda.max_batched_tokens == DEFAULT_MAX_BATCHED_TOKENS


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_given_budget_wins_on_either_device(device: str) -> None:
    given = parse_settings("prefill", ["--device", device, "--max-batched-tokens", "4096"], environ={})
    assert given.max_batched_tokens == 4096
    from_env = parse_settings("decode", ["--device", device], environ={"HYBRID_PD_MAX_BATCHED_TOKENS": "64"})
    assert from_env.max_batched_tokens == 64


def test_help_states_both_defaults() -> None:
    text = " ".join(build_parser("prefill").format_help().split())
    assert f"Default: {CPU_MAX_BATCHED_TOKENS} with --device cpu" in text
    assert f"{DEFAULT_MAX_BATCHED_TOKENS} with --device cuda" in text


def test_a_budget_below_one_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_settings("prefill", ["--max-batched-tokens", "0"], environ={})
    assert stopped.value.code == 2
    assert "--max-batched-tokens = '0': must be >= 1" in capsys.readouterr().err
