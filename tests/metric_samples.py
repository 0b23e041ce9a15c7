"""Reading the services' Prometheus metrics in tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def samples(exposition: str) -> dict[str, float]:
    """Every sample of a text exposition, keyed `name` or `name{k=v,...}` (labels sorted)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape(url: str) -> dict[str, float]:
    """Every sample a /metrics endpoint serves now."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        return samples(reply.read().decode())


def sample(exposition: str, name: str) -> float:
    """One unlabelled sample; the test fails when it is not exposed."""
    found = samples(exposition)
    assert name in found, f"{name} not exposed"
    return found[name]
