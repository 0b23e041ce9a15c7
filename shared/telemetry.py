"""Prometheus metrics of one service, all named `hybrid_pd_*`, in one place.

Each service owns a `Telemetry` with its own registry (two services in one test process must
not share counters) and serves it over HTTP on `--metrics-port`. Labels stay low-cardinality:
sections, reasons, results and statuses; never request ids or ranks (block counts are per engine).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

# Transfers on DRAM take microseconds to a few hundred milliseconds; on GPUs similar.
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
SECTIONS = ("fa", "conv", "ssm")


class Telemetry:
    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.transferred_bytes = Counter(
            "hybrid_pd_transferred_bytes", "Bytes moved by NIXL READs, by kind of state", ["section"], registry=r
        )
        self.transfer_seconds = Histogram(
            "hybrid_pd_transfer_seconds", "One READ: post to completion", buckets=LATENCY_BUCKETS, registry=r
        )
        self.post_seconds = Histogram(
            "hybrid_pd_post_seconds", "One READ: make_prepped_xfer + transfer() call", buckets=LATENCY_BUCKETS, registry=r
        )
        self.descriptors_per_read = Histogram(
            "hybrid_pd_descriptors_per_read",
            "Descriptors in one READ (before NIXL merges adjacent ones)",
            buckets=DESCRIPTOR_BUCKETS,
            registry=r,
        )
        self.failures = Counter("hybrid_pd_failures", "Failed transfers and requests, by reason", ["reason"], registry=r)
        # Per engine, not per rank: one allocator serves every rank with the same block ids.
        self.blocks_in_use = Gauge(
            "hybrid_pd_blocks_in_use", "Cache blocks held by requests (every rank holds the same ids)", registry=r
        )
        self.blocks_total = Gauge("hybrid_pd_blocks_total", "Cache blocks of the engine (per rank)", registry=r)
        self.lease_expiries = Counter("hybrid_pd_lease_expiries", "Pinned requests freed by lease expiry", registry=r)
        self.handshakes = Counter("hybrid_pd_handshakes", "Handshakes, by result", ["result"], registry=r)
        self.requests = Counter("hybrid_pd_requests", "Requests finished, by gRPC status", ["status"], registry=r)
        self.unknown_notifications = Counter(
            "hybrid_pd_unknown_notifications", "NIXL notifications for unknown requests (ignored)", registry=r
        )
        self.time_to_first_token = Histogram(
            "hybrid_pd_time_to_first_token_seconds",
            "Generate received to first token sent",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.digest_mismatches = Counter(
            "hybrid_pd_digest_mismatches",
            "Transferred state whose digest differs from prefill's, by section",
            ["section"],
            registry=r,
        )
        for section in SECTIONS:
            self.transferred_bytes.labels(section=section)
            self.digest_mismatches.labels(section=section)

    def exposition(self) -> str:
        """The Prometheus text format of every metric (tests, debugging)."""
        return generate_latest(self.registry).decode()
