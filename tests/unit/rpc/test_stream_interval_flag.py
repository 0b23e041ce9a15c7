"""--stream-interval (decode): 1 by default, from the flag or the environment; a value below 1 is
refused at start-up with a message naming the flag; prefill does not take it."""

from __future__ import annotations

import pytest

from shared.config import build_parser, parse_settings


def test_one_token_per_chunk_by_default_and_n_from_flag_or_env() -> None:
    assert parse_settings("decode", [], environ={}).stream_interval == 1
    assert parse_settings("decode", ["--stream-interval", "8"], environ={}).stream_interval == 8
    assert parse_settings("decode", [], environ={"HYBRID_PD_STREAM_INTERVAL": "3"}).stream_interval == 3


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--stream-interval", "0"], {}, "--stream-interval = '0': must be >= 1"),
        (["--stream-interval", "-2"], {}, "--stream-interval = '-2': must be >= 1"),
        (["--stream-interval", "four"], {}, "--stream-interval = 'four'"),
        ([], {"HYBRID_PD_STREAM_INTERVAL": "0"}, "--stream-interval (from HYBRID_PD_STREAM_INTERVAL) = '0': must be >= 1"),
    ],
)
def test_a_value_below_one_is_refused_naming_the_flag(
    argv: list[str], env: dict[str, str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_settings("decode", argv, environ=env)
    assert stopped.value.code == 2
    assert needle in capsys.readouterr().err


def test_a_decode_flag_that_prefill_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--stream-interval", "4"], environ={})
    assert "--stream-interval is a decode-svc flag" in capsys.readouterr().err
    assert "--stream-interval" in build_parser("decode").format_help()
