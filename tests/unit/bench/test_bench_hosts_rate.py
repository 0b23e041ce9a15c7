"""`bench transfer --hosts --link-rate`: the tc rate, in GB/s, that the result's link shares divide by."""

from __future__ import annotations

import pytest

from hybridpd_tools.bench.hosts import rate_gbps

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("rate", "gbps"),
    [("10gbit", 1.25), ("100mbit", 0.0125), ("1.5gbps", 1.5), ("8kibit", 0.000001024), ("25Gbit", 3.125), ("800bit", 1e-7)],
)
def test_tc_rates_in_gigabytes_per_second(rate: str, gbps: float) -> None:
    assert rate_gbps(rate) == pytest.approx(gbps)


@pytest.mark.parametrize("rate", ["10", "fast", "10gb", "-1gbit", "10xbit"])
def test_rates_tc_would_not_read_as_these_give_none(rate: str) -> None:
    assert rate_gbps(rate) is None
