"""--native-kernels (both services): on by default, off from the flag or the environment; it
reaches the paged engine, and decode's start-up line says which path its steps take."""

from __future__ import annotations

import pytest

from shared.config import Role, build_parser, parse_settings
from shared.engine.paged.attention_kernel import attention_kernel
from shared.engine.paged.conv_kernel import conv_step_kernel
from shared.engine.paged.mamba2_kernel import mamba2_state_kernel
from shared.runtime.engine_host import engine_line


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_on_by_default_and_off_by_flag_or_env(role: Role, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_settings(role, [], environ={}).native_kernels is True
    assert parse_settings(role, ["--native-kernels", "off"], environ={}).native_kernels is False
    assert parse_settings(role, [], environ={"HYBRID_PD_NATIVE_KERNELS": "false"}).native_kernels is False
    with pytest.raises(SystemExit):
        parse_settings(role, ["--native-kernels", "maybe"], environ={})
    assert "--native-kernels = 'maybe'" in capsys.readouterr().err


def test_help_says_what_it_changes() -> None:
    text = " ".join(build_parser("decode").format_help().split())
    assert "the Mamba2 conv and state updates in place in the state pages" in text
    assert "attention reading K/V where they lie in the blocks" in text
    assert "off (or no compiler) runs the torch path" in text


def test_decode_start_up_line_says_the_path() -> None:
    def line(*argv: str) -> str:
        return engine_line(parse_settings("decode", ["--engine", "paged", "--model", "ckpt", *argv], environ={}), "m")[1]

    assert line("--native-kernels", "off").endswith("; decode kernels: torch path (--native-kernels off)")
    built = all(k() is not None for k in (conv_step_kernel, mamba2_state_kernel, attention_kernel))
    said = (
        "C (Mamba2 conv and state updates, attention; fp32 models on a CPU)" if built else "torch path (a C kernel did not build"
    )
    assert "; decode kernels: " + said in line()
    # Prefill runs no decode steps, and the other engines have no kernels: nothing is said.
    assert "kernels" not in engine_line(parse_settings("prefill", ["--engine", "paged", "--model", "ckpt"], environ={}), "m")[1]
    assert "kernels" not in engine_line(parse_settings("decode", ["--engine", "hf", "--model", "ckpt"], environ={}), "m")[1]
