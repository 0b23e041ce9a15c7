"""Line and bar charts for the benchmark reports, with no required dependency.

`save(chart, path)` writes a PNG through matplotlib when it is installed; otherwise, and for
`.svg` paths, it writes an SVG drawn here (a few hundred bytes of markup, opens in any
browser). When a PNG was asked for but matplotlib is missing, the SVG goes next to it and the
returned note says so.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Literal

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
W, H = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 80, 170, 40, 60


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


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 2.5 or 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 12))
    return ticks


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


def _y_axis(chart: Chart, plot_h: int) -> tuple[list[float], Callable[[float], float]]:
    """Tick values and the value -> pixel row mapping of the y axis."""
    finite = [y for s in chart.series for y in s.ys if math.isfinite(y)]
    positive = [y for y in finite if y > 0]
    if chart.log10_y and positive:
        lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
        hi = max(hi, lo + 1)
        ticks = [10.0**k for k in range(lo, hi + 1)]

        def log_row(y: float) -> float:
            v = math.log10(y) if y > 0 else lo
            return TOP + plot_h - (v - lo) / (hi - lo) * plot_h

        return ticks, log_row
    ticks = nice_ticks(min(0.0, *finite) if finite else 0.0, max(finite) if finite else 1.0)
    y_lo, y_hi = ticks[0], ticks[-1]
    return ticks, lambda y: TOP + plot_h - (y - y_lo) / (y_hi - y_lo) * plot_h


def render_svg(chart: Chart) -> str:
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    y_ticks, py = _y_axis(chart, plot_h)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="{15 if len(chart.title) <= 70 else 12}">'
        f"{escape(chart.title)}</text>",
    ]
    for t in y_ticks:
        y = py(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>')
    if chart.kind == "bar":
        out += _bars(chart, py, plot_w)
    else:
        out += _lines(chart, py, plot_w)
    out += [
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="black"/>',
        f'<text x="{LEFT + plot_w / 2}" y="{H - 14}" text-anchor="middle">{escape(chart.x_label)}</text>',
        f'<text x="18" y="{TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 18 {TOP + plot_h / 2})">{escape(chart.y_label)}</text>',
        "</svg>",
    ]
    return "\n".join(out) + "\n"


def _lines(chart: Chart, py: Callable[[float], float], plot_w: int) -> list[str]:
    xs_all = [x for s in chart.series for x in s.xs]
    if not xs_all:
        return []

    def tx(x: float) -> float:
        return math.log2(x) if chart.log2_x else x

    lo, hi = min(map(tx, xs_all)), max(map(tx, xs_all))
    span = (hi - lo) or 1.0

    def px(x: float) -> float:
        return LEFT + (tx(x) - lo) / span * plot_w

    out: list[str] = []
    ticks = sorted(set(xs_all))
    step = max(1, math.ceil(len(ticks) / 8))  # at most ~8 labels: they must not overlap
    label = binary_fmt if chart.log2_x else fmt
    for x in ticks[::step]:
        out.append(f'<text x="{px(x):.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{label(x)}</text>')
    for i, s in enumerate(chart.series):
        color = COLORS[i % len(COLORS)]
        pts = [(px(x), py(y)) for x, y in zip(s.xs, s.ys) if math.isfinite(y)]
        if pts:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>' for x, y in pts]
        ly = TOP + 10 + 18 * i
        out.append(f'<line x1="{W - RIGHT + 12}" y1="{ly}" x2="{W - RIGHT + 32}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{W - RIGHT + 38}" y="{ly + 4}">{escape(s.name)}</text>')
    return out


def _bars(chart: Chart, py: Callable[[float], float], plot_w: int) -> list[str]:
    values = list(chart.series[0].ys) if chart.series else []
    labels = list(chart.categories) or [str(i) for i in range(len(values))]
    if not values:
        return []
    slot = plot_w / len(values)
    out: list[str] = []
    for i, (label, value) in enumerate(zip(labels, values)):
        x = LEFT + slot * i + slot * 0.15
        top = py(value if math.isfinite(value) else 0.0)
        out.append(
            f'<rect x="{x:.1f}" y="{top:.1f}" width="{slot * 0.7:.1f}" height="{py(0.0) - top:.1f}" '
            f'fill="{COLORS[i % len(COLORS)]}"/>'
        )
        out.append(f'<text x="{x + slot * 0.35:.1f}" y="{top - 4:.1f}" text-anchor="middle">{fmt(value)}</text>')
        out.append(f'<text x="{x + slot * 0.35:.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{escape(label)}</text>')
    return out


def _matplotlib_png(chart: Chart, path: Path) -> None:
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
        # Same x ticks as the SVG: the measured x values, at most ~8 labels.
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
    fig.savefig(path, format="png")


def save(chart: Chart, path: str | Path) -> tuple[Path, str]:
    """Write `chart`; returns (the file written, a note for the user, empty when as asked)."""
    target = Path(path)
    if target.suffix.lower() == ".png":
        try:
            _matplotlib_png(chart, target)
            return target, ""
        except ImportError:
            fallback = target.with_suffix(".svg")
            fallback.write_text(render_svg(chart))
            return fallback, f"matplotlib is not installed (pip install matplotlib for PNG): wrote SVG to {fallback} instead"
    svg = target if target.suffix.lower() == ".svg" else target.with_suffix(target.suffix + ".svg")
    svg.write_text(render_svg(chart))
    note = "" if svg == target else f"unknown image suffix {target.suffix!r}: wrote SVG to {svg}"
    return svg, note


def sibling(path: str | Path, tag: str) -> Path:
    """`out.png` + `throughput` -> `out-throughput.png` (one file per chart of a command)."""
    p = Path(path)
    return p.with_name(f"{p.stem}-{tag}{p.suffix or '.svg'}")
