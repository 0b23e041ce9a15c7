"""Prometheus metrics of both services over HTTP after real requests: names prefixed
`hybrid_pd_`, bytes by section, durations, descriptors, blocks, handshakes, statuses, TTFT,
and low-cardinality labels (no request ids)."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from tests.integration.exactness.pair import service_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            key = match["name"] + ("{" + match["labels"] + "}" if match["labels"] else "")
            samples[key] = float(match["value"])
    return samples


@pytest.mark.asyncio
async def test_metrics_after_requests() -> None:
    flags = ["--metrics-port", "0"]
    async with service_pair("tiny-mamba2", 2, 4, engine="synthetic", extra_prefill=flags, extra_decode=flags) as pair:
        results = await asyncio.gather(*(pair.generate(list(range(1, 30 + i)), 3) for i in range(4)))
        assert all(len(r.token_ids) == 3 for r in results)
        assert pair.decode.shell.metrics_port and pair.prefill.shell.metrics_port
        decode = await asyncio.to_thread(scrape, pair.decode.shell.metrics_port)
        prefill = await asyncio.to_thread(scrape, pair.prefill.shell.metrics_port)
    moved = {s: decode[f'hybrid_pd_transferred_bytes_total{{section="{s}"}}'] for s in ("fa", "conv", "ssm")}
    assert all(v > 0 for v in moved.values()), moved
    assert sum(moved.values()) == sum(r.summary.transfer.total_bytes for r in results)
    assert decode["hybrid_pd_transfer_seconds_count"] == 4
    assert decode["hybrid_pd_post_seconds_count"] == sum(r.summary.transfer.read_count for r in results)
    assert decode["hybrid_pd_descriptors_per_read_count"] == 4
    assert decode["hybrid_pd_time_to_first_token_seconds_count"] == 4
    assert decode['hybrid_pd_requests_total{status="OK"}'] == 4
    assert any(k.startswith("hybrid_pd_handshakes_total") and v >= 1 for k, v in prefill.items())
    for samples in (decode, prefill):  # one value per engine, not one per rank (they are all the same)
        assert sorted(k for k in samples if k.startswith("hybrid_pd_blocks_")) == [
            "hybrid_pd_blocks_in_use",
            "hybrid_pd_blocks_total",
        ]
    ids = {r.summary.request_id for r in results}
    for samples in (decode, prefill):
        for key in samples:
            assert key.startswith(("hybrid_pd_", "process_", "python_")), key
            assert not any(i in key for i in ids), f"request id in a label: {key}"
