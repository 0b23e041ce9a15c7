"""Line and bar charts for the benchmark reports, drawn by matplotlib (the `plot` extra).

`save(chart, path)` writes PNG or SVG by the path's suffix. `--plot` is refused before a
benchmark runs when matplotlib is missing (`available`), rather than after a long run.
"""

from __future__ import annotations

import importlib.util
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
W, H = 720, 420  # pixels at 100 dpi
FORMATS = {".png": "png", ".svg": "svg"}
MISSING_MATPLOTLIB = "needs matplotlib: pip install 'hybrid-pd[plot]' (or the dev extra)"


def available() -> bool:
    """Whether matplotlib can be imported (found without importing it: --help stays fast)."""
    return importlib.util.find_spec("matplotlib") is not None


@dataclass(frozen=True)
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]


@dataclass(frozen=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    series: Sequence[Series] = field(default_factory=tuple)
    kind: Literal["line", "bar"] = "line"
    log2_x: bool = False  # concurrency 1, 2, 4 ... and prompt lengths read better on a log2 axis
    log10_y: bool = False  # quantities spanning orders of magnitude (bytes against prompt length)
    categories: Sequence[str] = field(default_factory=tuple)  # bar charts: one label per bar


def fmt(value: float) -> str:
    """Short tick label: 1.5k, 2M, 0.25."""
    magnitude = abs(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def binary_fmt(value: float) -> str:
    """Tick label for powers of two: 1024 -> 1k, 131072 -> 128k (token counts)."""
    if value >= 1024 and value % 1024 == 0:
        return f"{int(value) // 1024}k"
    return fmt(value)


def _draw(chart: Chart, path: Path, fmt_name: str) -> None:
    # Figure + FigureCanvasAgg, not pyplot: no global backend switch (matplotlib.use) and no
    # figure registry, so callers that use pyplot with their own backend are left alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator

    fig = Figure(figsize=(W / 100, H / 100), dpi=100)
    FigureCanvasAgg(fig)  # attaches itself to fig; savefig then renders through Agg
    ax = fig.add_subplot()
    if chart.kind == "bar":
        values = list(chart.series[0].ys) if chart.series else []
        labels = list(chart.categories) or [str(i) for i in range(len(values))]
        # Numeric positions, not the labels: string x values would merge duplicate categories.
        positions = list(range(len(values)))
        colors = [COLORS[i % len(COLORS)] for i in positions]
        bars = ax.bar(positions, values, color=colors)
        ax.bar_label(bars, labels=[fmt(v) for v in values])
        ax.set_xticks(positions, labels=labels[: len(values)])
    else:
        for i, s in enumerate(chart.series):
            ax.plot(list(s.xs), list(s.ys), marker="o", color=COLORS[i % len(COLORS)], label=s.name)
        if chart.log2_x:
            ax.set_xscale("log", base=2)
        # The measured x values as ticks, at most ~8 labels: they must not overlap.
        ticks = sorted({x for s in chart.series for x in s.xs})
        if ticks:
            label = binary_fmt if chart.log2_x else fmt
            shown = ticks[:: max(1, math.ceil(len(ticks) / 8))]
            ax.set_xticks(shown, labels=[label(x) for x in shown])
            ax.xaxis.set_minor_locator(NullLocator())
        if chart.series:
            ax.legend()  # without series matplotlib warns "no artists with labels"
    if chart.log10_y:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(v)))
    # Benchmark titles run to ~90 characters: wrap them rather than let the canvas clip them.
    ax.set_title("\n".join(textwrap.wrap(chart.title, 70)) or chart.title, fontsize=12)
    ax.set_xlabel(chart.x_label)
    ax.set_ylabel(chart.y_label)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format=fmt_name)


def save(chart: Chart, path: str | Path) -> tuple[Path, str]:
    """Write `chart` as PNG or SVG (by suffix); returns (the file written, a note for the user,
    empty when as asked). Raises RuntimeError when matplotlib is missing."""
    target = Path(path)
    fmt_name = FORMATS.get(target.suffix.lower())
    note = ""
    if fmt_name is None:
        target, fmt_name = target.with_suffix(target.suffix + ".png"), "png"
        note = f"unknown image suffix {Path(path).suffix!r}: wrote PNG to {target}"
    try:
        _draw(chart, target, fmt_name)
    except ImportError as e:
        raise RuntimeError(f"charts {MISSING_MATPLOTLIB}") from e
    return target, note


def sibling(path: str | Path, tag: str) -> Path:
    """`out.png` + `throughput` -> `out-throughput.png` (one file per chart of a command)."""
    p = Path(path)
    return p.with_name(f"{p.stem}-{tag}{p.suffix or '.png'}")
