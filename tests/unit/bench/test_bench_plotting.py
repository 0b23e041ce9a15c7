"""Charts through matplotlib: PNG and SVG by suffix, and --plot refused up front without it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hybridpd_tools.bench import plotting
from hybridpd_tools.bench.plotting import Chart, Series, save, sibling
from hybridpd_tools.cli.main import main

pytestmark = pytest.mark.timeout(30)

LINES = Chart(
    "Tokens/s <per core>",
    "concurrency",
    "tokens/s",
    [Series("disaggregated", [1, 2, 4], [10.0, 18.0, 30.0]), Series("colocated", [1, 2, 4], [12.0, math.nan, 25.0])],
    log2_x=True,
)


def test_svg_by_suffix_is_well_formed_and_carries_the_labels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written, note = save(LINES, tmp_path / "chart.svg")
    assert written == tmp_path / "chart.svg" and note == ""
    root = ET.fromstring(written.read_text())  # raises on malformed markup
    assert root.tag.endswith("svg")
    # matplotlib draws text as glyph paths, and names each text element after its content.
    markup = written.read_text()
    for want in ("concurrency", "tokens/s", "disaggregated", "colocated"):
        assert want in markup, want


def test_an_unknown_suffix_gets_a_png_and_says_so(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written, note = save(LINES, tmp_path / "chart.gif")
    assert written == tmp_path / "chart.gif.png" and str(written) in note
    assert written.read_bytes().startswith(PNG_SIGNATURE)
    assert sibling(tmp_path / "out.png", "ttft") == tmp_path / "out-ttft.png"


def test_plot_without_matplotlib_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Fake: matplotlib is installed here, so its absence is simulated.
    monkeypatch.setattr(plotting, "available", lambda: False)
    target = tmp_path / "x.png"
    # Were the refusal missing, this tiny run would go ahead, write the chart and return 0.
    code = main(["bench", "transfer", "--model", "tiny-mamba2", "--requests", "1", "--warmup", "0", "--plot", str(target)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--plot {target} needs matplotlib" in err and "hybrid-pd[plot]" in err
    assert not target.exists()


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "chart",
    [
        LINES,  # log2 x, a nan point
        Chart(
            "GB/s", "", "GB/s", [Series("GB/s", [0, 1, 2], [3.2, 8.0, 3.2])], kind="bar", categories=["ours", "memcpy", "ours"]
        ),
        Chart(
            "bytes", "prompt tokens", "MB", [Series("K/V", [1024, 2048, 4096], [0.5, 10.0, 1000.0])], log2_x=True, log10_y=True
        ),
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
        "from hybridpd_tools.bench.plotting import Chart, Series, save\n"
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
