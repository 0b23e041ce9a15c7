"""The stderr progress bar: counts, finishes once, silent when disabled."""

from __future__ import annotations

import io

import pytest

from hybridpd_tools.bench.progress import Progress

pytestmark = pytest.mark.timeout(30)


def test_plain_stream_prints_start_and_end_lines() -> None:
    out = io.StringIO()  # not a terminal: whole lines, no carriage returns
    with Progress("bench x", 3, stream=out) as p:
        for _ in range(3):
            p.advance(note="step")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("bench x [") and "0/3" in lines[0]
    assert "3/3" in lines[-1] and "step" in lines[-1]
    assert sum("3/3" in line for line in lines) == 1
    assert "\r" not in out.getvalue()


def test_disabled_and_overshoot() -> None:
    out = io.StringIO()
    with Progress("quiet", 2, stream=out, enabled=False) as p:
        p.advance(5)
    assert out.getvalue() == ""
    assert p.done == 2  # never past the total
