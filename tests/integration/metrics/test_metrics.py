"""Prometheus metrics of both services over HTTP after real requests: names prefixed
`hybrid_pd_`, bytes by section, durations, descriptors, blocks, handshakes, statuses, TTFT,
and low-cardinality labels (no request ids)."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest

from tests.integration.exactness.pair import service_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape_text(port: int) -> str:
    text: str = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return text


def scrape(port: int) -> dict[str, float]:
    text = scrape_text(port)
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
    assert decode["hybrid_pd_request_duration_seconds_count"] == 4
    assert decode["hybrid_pd_inter_token_latency_seconds_count"] == 4 * 2  # 3 tokens: 2 gaps each
    # n-1 boundary: 3 decode steps a request; every step counts once, however many shared it.
    steps = decode["hybrid_pd_decode_step_seconds_count"]
    assert steps == decode["hybrid_pd_decode_batch_size_count"] and 3 <= steps <= 4 * 3
    assert decode["hybrid_pd_decode_batch_size_sum"] == 4 * 3
    assert decode["hybrid_pd_queue_wait_seconds_count"] == 4 and prefill["hybrid_pd_queue_wait_seconds_count"] == 4
    # Nothing waits for blocks once every request ended (test_services_decode_blocks.py sees it at 1).
    assert decode["hybrid_pd_requests_queued_for_blocks"] == 0 and prefill["hybrid_pd_requests_queued_for_blocks"] == 0
    # Buckets reach past a long prompt's TTFT (16 s seen at 60k tokens).
    assert 'hybrid_pd_time_to_first_token_seconds_bucket{le="120.0"}' in decode
    # Failure labels exist before any failure, so rate() starts from zero.
    assert decode['hybrid_pd_requests_total{status="DEADLINE_EXCEEDED"}'] == 0
    assert decode['hybrid_pd_failures_total{reason="CACHE_FULL"}'] == 0
    for samples in (decode, prefill):
        assert any(k.startswith("hybrid_pd_build_info{") and v == 1 for k, v in samples.items())
    # Per role: prefill exports no decode-only series, and decode none of prefill's.
    assert not any(k.startswith(("hybrid_pd_requests_total", "hybrid_pd_transferred_bytes")) for k in prefill)
    assert not any(k.startswith(("hybrid_pd_handshakes_total", "hybrid_pd_lease_expiries")) for k in decode)
    assert any(k.startswith("hybrid_pd_handshakes_total") and v >= 1 for k, v in prefill.items())
    for samples in (decode, prefill):  # one value per engine, not one per rank (they are all the same)
        assert sorted(k for k in samples if k.startswith("hybrid_pd_blocks_")) == [
            "hybrid_pd_blocks_capacity",
            "hybrid_pd_blocks_in_use",
        ]
    ids = {r.summary.request_id for r in results}
    for samples in (decode, prefill):
        for key in samples:
            assert key.startswith(("hybrid_pd_", "process_", "python_")), key
            assert not any(i in key for i in ids), f"request id in a label: {key}"


TYPE_LINE = re.compile(r"^# TYPE (?P<name>\S+) (?P<kind>\S+)$")
UNIT_WORDS = {"seconds": ("second", "duration", "latency", "time", "wait"), "bytes": ("byte", "memory")}


def convention_problems(text: str) -> list[str]:
    """Prometheus naming: counters end in _total, gauges and histograms do not; a duration ends
    in _seconds and a size in _bytes (before _total); our own metrics start with hybrid_pd_."""
    problems = []
    for line in text.splitlines():
        match = TYPE_LINE.match(line)
        if not match:
            continue
        name, kind = match["name"], match["kind"]
        if name.endswith("_created"):  # the client library's creation-time series of a counter or histogram
            continue
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f"counter {name} does not end in _total")
        if kind in ("gauge", "histogram") and name.endswith(("_total", "_count", "_sum", "_bucket")):
            problems.append(f"{kind} {name} ends like a counter or histogram series")
        if not name.startswith("hybrid_pd_"):
            if not name.startswith(("process_", "python_")):
                problems.append(f"{name}: not ours and not the client library's")
            continue
        base = name.removesuffix("_total")
        for unit, words in UNIT_WORDS.items():
            if any(w in base.removeprefix("hybrid_pd_") for w in words) and not base.endswith(f"_{unit}"):
                problems.append(f"{name} measures {unit} but does not end in _{unit}")
    return problems


def test_the_convention_check_catches_bad_names() -> None:
    """Negative control: each rule fires on a name that breaks it."""
    for bad in (
        "# TYPE hybrid_pd_blocks_total gauge",
        "# TYPE hybrid_pd_requests counter",
        "# TYPE hybrid_pd_read_time histogram",
        "# TYPE hybrid_pd_moved_bytes_count gauge",
        "# TYPE somebody_else gauge",
    ):
        assert convention_problems(bad), bad
    assert convention_problems("# TYPE hybrid_pd_transfer_seconds histogram\n# TYPE hybrid_pd_requests_total counter") == []


@pytest.mark.asyncio
async def test_every_exported_name_follows_the_conventions_on_both_roles() -> None:
    flags = ["--metrics-port", "0"]
    async with service_pair("tiny-mamba2", 1, 1, engine="synthetic", extra_prefill=flags, extra_decode=flags) as pair:
        await pair.generate([1, 2, 3], 2)
        assert pair.decode.shell.metrics_port and pair.prefill.shell.metrics_port
        texts = {
            "decode": await asyncio.to_thread(scrape_text, pair.decode.shell.metrics_port),
            "prefill": await asyncio.to_thread(scrape_text, pair.prefill.shell.metrics_port),
        }
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    for role, text in texts.items():
        assert text.count("# TYPE hybrid_pd_") > 5, role
        assert convention_problems(text) == [], role
        # Operators look metrics up in the README: every one a service exports is listed there.
        exported = {n for n in re.findall(r"^# TYPE (hybrid_pd_\w+)", text, re.MULTILINE) if not n.endswith("_created")}
        assert sorted(n for n in exported if not re.search(rf"`{n}[`{{]", readme)) == [], role
