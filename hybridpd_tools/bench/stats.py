"""Small statistics for benchmark samples: medians, percentiles, throughput and ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks (numpy's
    default method); nan if empty."""
    if not samples:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50)


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second); nan when the time is not positive."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def ratio(ours: float, baseline: float) -> float:
    """ours / baseline; nan when the baseline is zero or either side is nan."""
    if baseline == 0 or math.isnan(baseline) or math.isnan(ours):
        return math.nan
    return ours / baseline


@dataclass(frozen=True)
class Summary:
    """Median, p99, min and max of one series of samples (same unit as the samples)."""

    count: int
    median: float
    p99: float
    min: float
    max: float

    @staticmethod
    def of(samples: Sequence[float]) -> Summary:
        if not samples:
            return Summary(0, math.nan, math.nan, math.nan, math.nan)
        return Summary(len(samples), median(samples), percentile(samples, 99), min(samples), max(samples))

    def scaled(self, factor: float) -> Summary:
        """The same summary in another unit (e.g. 1e3 for seconds -> ms)."""
        return Summary(self.count, self.median * factor, self.p99 * factor, self.min * factor, self.max * factor)

    def as_dict(self, digits: int = 4) -> dict[str, float | int | None]:
        return {
            "count": self.count,
            "median": json_number(self.median, digits),
            "p99": json_number(self.p99, digits),
            "min": json_number(self.min, digits),
            "max": json_number(self.max, digits),
        }


def json_number(value: float, digits: int = 4) -> float | None:
    """A float for JSON: rounded to `digits` significant digits, None for nan/inf (JSON has neither)."""
    if math.isnan(value) or math.isinf(value):
        return None
    if value == 0:
        return 0.0
    return round(value, max(0, digits - 1 - math.floor(math.log10(abs(value)))))


def ms_summary(values: Sequence[float]) -> dict[str, Any]:
    """The summary, in ms, of durations in seconds; NaN marks a sample that has none."""
    return Summary.of([v for v in values if not math.isnan(v)]).scaled(1e3).as_dict()


def fixed(value: Any, digits: int) -> str:
    """A table cell: `value` with `digits` decimals, "-" where there is none."""
    return "-" if value is None else f"{value:.{digits}f}"


def megabytes(value: Any) -> str:
    """A table cell: bytes as MB, "-" where there are none."""
    return "-" if value is None else f"{value / 1e6:.3f}"
