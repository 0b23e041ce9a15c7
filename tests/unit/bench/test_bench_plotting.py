"""Charts without matplotlib: well-formed SVG with the labels, and a clear fallback note."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from shared.bench import plotting
from shared.bench.plotting import Chart, Series, nice_ticks, render_svg, save, sibling

pytestmark = pytest.mark.timeout(30)

LINES = Chart(
    "Tokens/s <per core>",
    "concurrency",
    "tokens/s",
    [Series("disaggregated", [1, 2, 4], [10.0, 18.0, 30.0]), Series("colocated", [1, 2, 4], [12.0, math.nan, 25.0])],
    log2_x=True,
)


def texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)  # raises on malformed markup
    return [el.text or "" for el in root.iter() if el.tag.endswith("text")]


def test_line_chart_is_valid_svg_with_title_axes_and_legend() -> None:
    labels = texts(render_svg(LINES))
    for want in ("Tokens/s <per core>", "concurrency", "tokens/s", "disaggregated", "colocated", "1", "2", "4"):
        assert want in labels
    assert render_svg(LINES).count("<polyline") == 2  # the nan point is skipped, not drawn at 0


def test_bar_and_log_charts() -> None:
    bars = Chart("GB/s", "", "GB/s", [Series("GB/s", [0, 1], [3.2, 8.0])], kind="bar", categories=["ours", "memcpy"])
    labels = texts(render_svg(bars))
    assert "ours" in labels and "memcpy" in labels and "3.2" in labels
    logs = Chart("bytes", "prompt tokens", "MB", [Series("K/V", [1024, 2048], [0.5, 1000.0])], log2_x=True, log10_y=True)
    labels = texts(render_svg(logs))
    assert "0.1" in labels and "1k" in labels  # decades on y, binary thousands on x


def test_nice_ticks_cover_the_range() -> None:
    ticks = nice_ticks(0.0, 37.0)
    assert ticks[0] <= 0.0 and ticks[-1] >= 37.0 and len(ticks) <= 8
    steps = {round(b - a, 9) for a, b in itertools.pairwise(ticks)}
    assert len(steps) == 1


def test_save_svg_and_png_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written, note = save(LINES, tmp_path / "chart.svg")
    assert written == tmp_path / "chart.svg" and note == "" and written.read_text().startswith("<svg")

    def no_matplotlib(chart: Chart, path: Path) -> None:  # fake: matplotlib may be installed here
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(plotting, "_matplotlib_png", no_matplotlib)
    written, note = save(LINES, tmp_path / "chart.png")
    assert written == tmp_path / "chart.svg"
    assert "matplotlib is not installed" in note and str(written) in note
    assert sibling(tmp_path / "out.png", "ttft") == tmp_path / "out-ttft.png"


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "chart",
    [
        LINES,  # log2 x, a nan point
        Chart("GB/s", "", "GB/s", [Series("GB/s", [0, 1, 2], [3.2, 8.0, 3.2])], kind="bar", categories=["ours", "memcpy", "ours"]),
        Chart("bytes", "prompt tokens", "MB", [Series("K/V", [1024, 2048, 4096], [0.5, 10.0, 1000.0])], log2_x=True, log10_y=True),
        Chart("linear", "x", "y", [Series("a", [0.5, 1.5, 3.0], [-1.0, 0.0, 2.5])]),
    ],
    ids=["line-log2x", "bar", "log2x-log10y", "line-linear"],
)
def test_save_png_with_matplotlib(chart: Chart, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "chart.png"
    written, note = save(chart, target)
    assert written == target and note == ""
    data = target.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 5_000  # a drawn 720x420 chart, not an empty canvas
    assert not (tmp_path / "chart.svg").exists()  # no fallback written


def test_png_differs_with_the_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    # Only the y values differ: title, labels, series and legend are LINES's own.
    flat = Chart(
        LINES.title, LINES.x_label, LINES.y_label,
        [Series(s.name, list(s.xs), [1.0] * len(s.xs)) for s in LINES.series], log2_x=LINES.log2_x,
    )  # fmt: skip
    save(LINES, tmp_path / "a.png")
    save(flat, tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() != (tmp_path / "b.png").read_bytes()


def test_png_leaves_the_pyplot_backend_alone(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    # A fresh interpreter: in this one an earlier test may already have resolved the backend.
    code = (
        "import sys, matplotlib\n"
        "from shared.bench.plotting import Chart, Series, save\n"
        "save(Chart('t', 'x', 'y', [Series('s', [1, 2], [1.0, 2.0])]), sys.argv[1])\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'\n"
        "assert matplotlib.rcParams._get_backend_or_none() is None, 'backend switched'\n"
    )
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}  # a user's backend choice would count as "switched"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c.png")], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_SIGNATURE)
