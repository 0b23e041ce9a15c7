"""Statistics of benchmark samples: percentiles, GB/s, ratios, JSON numbers."""

from __future__ import annotations

import math

import pytest

from hybridpd_tools.bench.stats import Summary, gbps, json_number, median, percentile, ratio

pytestmark = pytest.mark.timeout(30)


def test_percentiles_interpolate_between_ranks() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]
    assert median(samples) == 2.5
    assert percentile(samples, 0) == 1.0
    assert percentile(samples, 100) == 4.0
    assert percentile(list(range(101)), 99) == 99.0
    assert math.isnan(median([]))
    with pytest.raises(ValueError):
        percentile(samples, 101)


def test_gbps_and_ratio() -> None:
    assert gbps(2e9, 0.5) == 4.0
    assert math.isnan(gbps(1, 0))
    assert ratio(3.0, 4.0) == 0.75
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(math.nan, 1.0))


def test_summary_and_json_numbers() -> None:
    s = Summary.of([0.001, 0.002, 0.003]).scaled(1e3)
    assert (s.count, s.median, s.min, s.max) == (3, 2.0, 1.0, 3.0)
    assert s.as_dict()["median"] == 2.0
    assert Summary.of([]).as_dict()["median"] is None  # JSON has no nan
    assert json_number(1.23456789, 4) == 1.235
    assert json_number(0.000123456, 3) == 0.000123
    assert json_number(math.inf) is None
