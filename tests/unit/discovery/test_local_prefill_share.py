"""--local-prefill share: the rule that decides when decode computes a prompt itself because
the least loaded prefill engine is busy (decode_svc/local_prefill.py `shares_load`), and the
flags that set it (parsed, defaulted, refused with the flag named)."""

from __future__ import annotations

import pytest

from decode_svc.local_prefill import shares_load
from shared.config import DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS, build_parser, parse_settings


def test_a_short_queue_stays_on_prefill() -> None:
    queue = DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS
    assert not shares_load(queue - 1, 0, queue)
    assert shares_load(queue, 0, queue)
    # Work, not jobs: 63 short prompts queued are less than four long ones.
    assert not shares_load(63 * 128, 0, queue)
    assert shares_load(4 * 2048, 0, queue)


def test_decode_never_holds_more_prompt_tokens_than_the_prefill_it_relieves() -> None:
    assert shares_load(5000, 4000, 2000)
    assert not shares_load(5000, 5000, 2000)
    assert not shares_load(5000, 9000, 2000)


def split(arrivals: int, tokens: int) -> tuple[int, int]:
    """Prompts of `tokens` arriving before any is done, each placed where the rule sends it at
    the default queue: how many go to prefill and how many stay on decode."""
    prefill, here = 0, 0
    for _ in range(arrivals):
        if shares_load(prefill * tokens, here * tokens, DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS):
            here += 1
        else:
            prefill += 1
    return prefill, here


def test_a_burst_of_long_prompts_splits_about_evenly() -> None:
    assert split(32, 2048) == (16, 16)
    # The negative control: with the threshold out of reach nothing is shared.
    assert not any(shares_load(tokens, 0, 33 * 2048) for tokens in range(0, 33 * 2048, 2048))


def test_a_burst_of_short_prompts_stays_on_prefill() -> None:
    """64 prompts of 128 tokens never make the default queue: decode takes none."""
    assert split(64, 128) == (64, 0)


def test_the_flags() -> None:
    default = parse_settings("decode", [], environ={})
    assert (default.local_prefill, default.local_prefill_queue_tokens) == ("fallback", DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS)
    shared = parse_settings("decode", ["--local-prefill", "share", "--local-prefill-queue-tokens", "2"], environ={})
    assert (shared.local_prefill, shared.local_prefill_queue_tokens) == ("share", 2)
    env = {"HYBRID_PD_LOCAL_PREFILL": "share", "HYBRID_PD_LOCAL_PREFILL_QUEUE_TOKENS": "7"}
    from_env = parse_settings("decode", [], environ=env)
    assert (from_env.local_prefill, from_env.local_prefill_queue_tokens) == ("share", 7)
    assert "share" in build_parser("decode").format_help()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--local-prefill-queue-tokens", "0"], "--local-prefill-queue-tokens = '0': must be >= 1"),
        (["--local-prefill", "always"], "--local-prefill = 'always': must be one of fallback, share, off"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_settings("decode", argv, environ={})
    assert stopped.value.code == 2
    assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings("prefill", ["--local-prefill-queue-tokens", "2"], environ={})
    assert "--local-prefill-queue-tokens is a decode-svc flag" in capsys.readouterr().err
