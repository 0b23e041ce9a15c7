"""--local-prefill share: the rule that decides when decode computes a prompt itself because
the least loaded prefill engine is busy (decode_svc/local_prefill.py `shares_load`), and the
flags that set it (parsed, defaulted, refused with the flag named)."""

from __future__ import annotations

import pytest

from decode_svc.local_prefill import shares_load
from shared.config import DEFAULT_LOCAL_PREFILL_QUEUE, build_parser, parse_settings


def test_a_trickle_stays_on_prefill() -> None:
    for jobs in range(DEFAULT_LOCAL_PREFILL_QUEUE):
        assert not shares_load(jobs, 0, DEFAULT_LOCAL_PREFILL_QUEUE)
    assert shares_load(DEFAULT_LOCAL_PREFILL_QUEUE, 0, DEFAULT_LOCAL_PREFILL_QUEUE)


def test_decode_never_holds_more_prompts_than_the_prefill_it_relieves() -> None:
    assert shares_load(5, 4, 2)
    assert not shares_load(5, 5, 2)
    assert not shares_load(5, 9, 2)


def test_a_burst_splits_about_evenly() -> None:
    """32 arrivals before any prompt is done: each goes where the rule sends it."""
    prefill, here = 0, 0
    for _ in range(32):
        if shares_load(prefill, here, 4):
            here += 1
        else:
            prefill += 1
    assert (prefill, here) == (16, 16)
    # The negative control: with the threshold out of reach nothing is shared.
    assert not any(shares_load(jobs, 0, 33) for jobs in range(33))


def test_the_flags() -> None:
    default = parse_settings("decode", [], environ={})
    assert (default.local_prefill, default.local_prefill_queue) == ("fallback", DEFAULT_LOCAL_PREFILL_QUEUE)
    shared = parse_settings("decode", ["--local-prefill", "share", "--local-prefill-queue", "2"], environ={})
    assert (shared.local_prefill, shared.local_prefill_queue) == ("share", 2)
    env = {"HYBRID_PD_LOCAL_PREFILL": "share", "HYBRID_PD_LOCAL_PREFILL_QUEUE": "7"}
    from_env = parse_settings("decode", [], environ=env)
    assert (from_env.local_prefill, from_env.local_prefill_queue) == ("share", 7)
    assert "share" in build_parser("decode").format_help()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--local-prefill-queue", "0"], "--local-prefill-queue = '0': must be >= 1"),
        (["--local-prefill", "always"], "--local-prefill = 'always': must be one of fallback, share, off"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_settings("decode", argv, environ={})
    assert stopped.value.code == 2
    assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--local-prefill-queue", "2"], environ={})
    assert "--local-prefill-queue is a decode-svc flag" in capsys.readouterr().err
