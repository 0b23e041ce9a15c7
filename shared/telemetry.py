"""Prometheus metrics of one service, all named `hybrid_pd_*`, in one place.

Each service owns a `Telemetry` with its own registry (two services in one test process must
not share counters) and serves it over HTTP on `--metrics-port`. Labels stay low-cardinality:
sections, reasons, results and statuses; never request ids or ranks (block counts are per engine).

Conventions (tests/integration/metrics/test_metrics.py checks every exported name): counters end in
`_total` (prometheus_client adds it), gauges and histograms never do, durations end in `_seconds`
and sizes in `_bytes`. Per role: a series only the other role can move is not exported (the
metric object still exists, unregistered, so shared code counts into it without checks). Label
values known in advance (sections, statuses) are pre-created, so a rate() sees them from zero.
"""

from __future__ import annotations

import platform

from opentelemetry.context import Context
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from shared.observe import (
    BATCH_SIZE,
    FAILURE_REASON,
    RELEASE_REASON,
    STATUS,
    TOKENS,
    TRANSFER_ATTENTION_BYTES,
    TRANSFER_CONV_BYTES,
    TRANSFER_DESCRIPTORS,
    TRANSFER_POST_SECONDS,
    TRANSFER_READS,
    TRANSFER_SSM_BYTES,
    Attributes,
    Count,
    Sink,
    Stage,
    number,
    numbers,
)
from shared.version import version

# One READ or one post: microseconds to a few seconds (a READ over a slow link up to its deadline).
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A whole request, its first token, or its wait for cache: a 60k-token prompt's TTFT is ~16 s.
REQUEST_BUCKETS = (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# Between two tokens of one request: a decode step, or a chunk of them.
TOKEN_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PREFILL_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
SECTIONS = ("fa", "conv", "ssm")
# gRPC statuses a request can end with here (pre-created on hybrid_pd_requests_total).
STATUSES = (
    "OK",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "INVALID_ARGUMENT",
    "ALREADY_EXISTS",
    "FAILED_PRECONDITION",
    "ABORTED",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "DATA_LOSS",
    "INTERNAL",
)
HANDSHAKE_RESULTS = ("ok", "invalid_argument", "failed_precondition", "unavailable")
# Failure reasons with their own count (ErrorInfo reasons other than the status's default).
FAILURE_REASONS = (
    "BAD_MANIFEST",
    "CACHE_FULL",
    "DIGEST_MISMATCH",
    "DRAINING",
    "DRAIN_GRACE_ENDED",
    "LEASE_EXPIRED",
    "NO_CREDIT",
    "NO_DIGESTS",
    "NO_PREFILL_PEER",
    "PEER_RESTARTED",
    "PEER_UNAVAILABLE",
    "READ_FAILED",
    "READ_TIMEOUT",
)
# Why a job was sent to another prefill engine before its manifest (decode_svc/prefill_retry.py).
PREFILL_RETRY_REASONS = ("PEER_UNAVAILABLE", "DRAINING", "NO_CREDIT", "CACHE_FULL", "UNAVAILABLE", "RESOURCE_EXHAUSTED")


class Telemetry(Sink):
    """A service's metrics; a sink of the stages its request paths report."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        both = self.registry
        decode = both if role == "decode" else None
        prefill = both if role == "prefill" else None
        self.build_info = Gauge(
            "hybrid_pd_build_info", "Always 1; the labels say what runs", ["version", "role", "python"], registry=both
        )
        self.build_info.labels(version=version(), role=role, python=platform.python_version()).set(1)
        # Both roles.
        self.blocks_in_use = Gauge(  # per engine, not per rank: one allocator serves every rank with the same ids
            "hybrid_pd_blocks_in_use",
            "Cache blocks reserved by requests (decode: grown as they generate; every rank holds the same ids)",
            registry=both,
        )
        self.blocks_capacity = Gauge("hybrid_pd_blocks_capacity", "Cache blocks of the engine (per rank)", registry=both)
        self.requests_queued_for_blocks = Gauge(
            "hybrid_pd_requests_queued_for_blocks",
            "Requests (decode: to start or to grow) and jobs (prefill) held up until cache blocks are freed",
            registry=both,
        )
        self.queue_wait = Histogram(
            "hybrid_pd_queue_wait_seconds",
            "A request's (decode) or job's (prefill) wait for free cache blocks",
            buckets=REQUEST_BUCKETS,
            registry=both,
        )
        self.unknown_notifications = Counter(
            "hybrid_pd_unknown_notifications", "NIXL notifications for unknown requests (ignored)", registry=both
        )
        # A series per reason from its first end (a reason never seen has none).
        self.pins_ended = Counter(
            "hybrid_pd_pins_ended", "Pinned requests ended, by reason (read, released, lease_expired, ...)",
            ["reason"], registry=both,
        )  # fmt: skip
        # Both roles: batched prefill steps (on decode, of the prompts it computes itself).
        self.prefill_batch_size = Histogram(
            "hybrid_pd_prefill_batch_size",
            "Prompts that computed a chunk in one batched prefill step (on decode: prompts it computes itself)",
            buckets=BATCH_BUCKETS,
            registry=both,
        )
        self.prefill_batch_tokens = Histogram(
            "hybrid_pd_prefill_batch_tokens",
            "Prompt tokens computed in one prefill step (at most --max-batched-tokens, or one larger chunk)",
            buckets=PREFILL_TOKEN_BUCKETS,
            registry=both,
        )
        self.prefill_step_seconds = Histogram(
            "hybrid_pd_prefill_step_seconds",
            "Engine time of one batched prefill step",
            buckets=LATENCY_BUCKETS,
            registry=both,
        )
        # Prefill only.
        self.lease_expiries = Counter("hybrid_pd_lease_expiries", "Pinned requests freed by lease expiry", registry=prefill)
        self.handshakes = Counter("hybrid_pd_handshakes", "Handshakes, by result", ["result"], registry=prefill)
        for result in HANDSHAKE_RESULTS:
            self.handshakes.labels(result=result)
        self.prefill_boundary_hits = Counter(
            "hybrid_pd_prefill_boundary_hits",
            "Jobs that started at a chunk boundary prefill's boundary cache held (prefix reuse on prefill)",
            registry=prefill,
        )
        self.prefill_boundary_misses = Counter(
            "hybrid_pd_prefill_boundary_misses",
            "Jobs the boundary cache could have served that found no cached boundary of their prompt",
            registry=prefill,
        )
        self.prefill_boundary_skipped_tokens = Counter(
            "hybrid_pd_prefill_boundary_skipped_tokens",
            "Prompt tokens prefill did not compute because the boundary cache held their state",
            registry=prefill,
        )
        self.prefill_boundary_evictions = Counter(
            "hybrid_pd_prefill_boundary_evictions",
            "Boundaries the boundary cache gave up (least recently used, when blocks were needed)",
            registry=prefill,
        )
        # Decode only.
        self.transferred_bytes = Counter(
            "hybrid_pd_transferred_bytes", "Bytes moved by NIXL READs, by kind of state", ["section"], registry=decode
        )
        self.transfer_seconds = Histogram(
            "hybrid_pd_transfer_seconds", "One READ: post to completion", buckets=LATENCY_BUCKETS, registry=decode
        )
        self.post_seconds = Histogram(
            "hybrid_pd_post_seconds", "One READ: make_prepped_xfer + transfer() call", buckets=LATENCY_BUCKETS, registry=decode
        )
        self.descriptors_per_read = Histogram(
            "hybrid_pd_descriptors_per_read",
            "Descriptors in one READ (before NIXL merges adjacent ones)",
            buckets=DESCRIPTOR_BUCKETS,
            registry=decode,
        )
        self.failures = Counter("hybrid_pd_failures", "Failed requests, by reason", ["reason"], registry=decode)
        self.requests = Counter("hybrid_pd_requests", "Requests finished, by gRPC status", ["status"], registry=decode)
        self.prefill_retries = Counter(
            "hybrid_pd_prefill_retries",
            "Jobs sent to another prefill engine after the chosen one failed them before the manifest, by reason",
            ["reason"],
            registry=decode,
        )
        self.time_to_first_token = Histogram(
            "hybrid_pd_time_to_first_token_seconds",
            "Generate received to first token sent",
            buckets=REQUEST_BUCKETS,
            registry=decode,
        )
        self.request_duration = Histogram(
            "hybrid_pd_request_duration_seconds",
            "Generate received to its last response, for requests that finished OK",
            buckets=REQUEST_BUCKETS,
            registry=decode,
        )
        self.inter_token_latency = Histogram(
            "hybrid_pd_inter_token_latency_seconds",
            "Between two tokens of one request (a chunk of n tokens counts n gaps of 1/n its time)",
            buckets=TOKEN_BUCKETS,
            registry=decode,
        )
        self.local_prefills = Counter(
            "hybrid_pd_local_prefills",
            "Prompts decode computed itself (--local-prefill), by reason: no_prefill_ready, short_prompt, prefill_busy",
            ["reason"],
            registry=decode,
        )
        for reason in ("no_prefill_ready", "short_prompt", "prefill_busy"):
            self.local_prefills.labels(reason=reason)
        self.decode_batch_size = Histogram(
            "hybrid_pd_decode_batch_size",
            "Requests that computed their next token in one decode step (continuous batching)",
            buckets=BATCH_BUCKETS,
            registry=decode,
        )
        self.decode_step_seconds = Histogram(
            "hybrid_pd_decode_step_seconds",
            "Engine time of one decode step of every running request",
            buckets=TOKEN_BUCKETS,
            registry=decode,
        )
        self.digest_mismatches = Counter(
            "hybrid_pd_digest_mismatches",
            "Transferred state whose digest differs from prefill's, by section",
            ["section"],
            registry=decode,
        )
        self.prefix_cache_hits = Counter(
            "hybrid_pd_prefix_cache_hits", "Requests whose prompt started with K/V blocks the prefix cache held", registry=decode
        )
        self.prefix_cache_misses = Counter(
            "hybrid_pd_prefix_cache_misses", "Requests the prefix cache held no leading block of", registry=decode
        )
        self.prefix_cache_evictions = Counter(
            "hybrid_pd_prefix_cache_evictions",
            "Blocks the prefix cache gave up (least recently used, or found corrupt)",
            registry=decode,
        )
        self.prefix_cache_saved_bytes = Counter(
            "hybrid_pd_prefix_cache_saved_bytes", "K/V bytes not READ because the prefix cache held them", registry=decode
        )
        self.prefix_state_hits = Counter(
            "hybrid_pd_prefix_state_hits",
            "Requests whose computed prompt had a state checkpoint: no prefill job, no READ",
            registry=decode,
        )
        self.prefix_state_misses = Counter(
            "hybrid_pd_prefix_state_misses", "Requests with state checkpoints on that found none to use", registry=decode
        )
        self.prefix_state_evictions = Counter(
            "hybrid_pd_prefix_state_evictions",
            "State checkpoints given up (least recently used, or found corrupt)",
            registry=decode,
        )
        self.prefix_state_saved_bytes = Counter(
            "hybrid_pd_prefix_state_saved_bytes",
            "Conv, SSM and attention bytes not READ because a state checkpoint held them",
            registry=decode,
        )
        self.prefix_state_without_prefill = Counter(
            "hybrid_pd_prefix_state_without_prefill",
            "Requests served from a state checkpoint while no prefill engine was ready",
            registry=decode,
        )
        # Each request counts its bytes per section: the children are resolved once, not by labels() each time.
        self.transferred_bytes_of = {section: self.transferred_bytes.labels(section=section) for section in SECTIONS}
        for section in SECTIONS:
            self.digest_mismatches.labels(section=section)
        # Each request counts its status: the children are resolved here, not by labels() each time.
        self.requests_of = {status: self.requests.labels(status=status) for status in STATUSES}
        for reason in FAILURE_REASONS:
            self.failures.labels(reason=reason)
        for reason in PREFILL_RETRY_REASONS:
            self.prefill_retries.labels(reason=reason)
        # What each count adds to: a counter, or one with a label its kind names.
        self._counters: dict[Count, Counter] = {
            Count.PREFIX_CACHE_HIT: self.prefix_cache_hits,
            Count.PREFIX_CACHE_MISS: self.prefix_cache_misses,
            Count.PREFIX_CACHE_EVICTED: self.prefix_cache_evictions,
            Count.PREFIX_CACHE_SAVED_BYTES: self.prefix_cache_saved_bytes,
            Count.PREFIX_STATE_HIT: self.prefix_state_hits,
            Count.PREFIX_STATE_MISS: self.prefix_state_misses,
            Count.PREFIX_STATE_EVICTED: self.prefix_state_evictions,
            Count.PREFIX_STATE_SAVED_BYTES: self.prefix_state_saved_bytes,
            Count.PREFIX_STATE_WITHOUT_PREFILL: self.prefix_state_without_prefill,
            Count.BOUNDARY_HIT: self.prefill_boundary_hits,
            Count.BOUNDARY_MISS: self.prefill_boundary_misses,
            Count.BOUNDARY_SKIPPED_TOKENS: self.prefill_boundary_skipped_tokens,
            Count.BOUNDARY_EVICTED: self.prefill_boundary_evictions,
        }
        self._counters_by_kind: dict[Count, Counter] = {
            Count.PREFILL_RETRY: self.prefill_retries,
            Count.LOCAL_PREFILL: self.local_prefills,
            Count.DIGEST_MISMATCH: self.digest_mismatches,
            Count.HANDSHAKE: self.handshakes,
        }

    def stage(self, stage: Stage, seconds: float, attributes: Attributes, within: Context | None) -> None:
        """The histograms and counters a reported stage feeds (shared/observe.py)."""
        if stage is Stage.DECODE_STEP:
            self.decode_batch_size.observe(number(attributes, BATCH_SIZE))
            self.decode_step_seconds.observe(seconds)
        elif stage is Stage.PREFILL_STEP:
            self.prefill_batch_size.observe(number(attributes, BATCH_SIZE))
            self.prefill_batch_tokens.observe(number(attributes, TOKENS))
            self.prefill_step_seconds.observe(seconds)
        elif stage is Stage.QUEUE_WAIT:
            self.queue_wait.observe(seconds)
        elif stage is Stage.TRANSFER:
            self._transfer(seconds, attributes)
        elif stage is Stage.RELEASE:
            reason = attributes[RELEASE_REASON]
            self.pins_ended.labels(reason=str(reason)).inc()
            if reason == "lease_expired":
                self.lease_expiries.inc()
        elif stage is Stage.TOKENS:
            n = number(attributes, TOKENS)
            for _ in range(int(n)):  # n gaps of 1/n the chunk's time each
                self.inter_token_latency.observe(seconds / n)
        elif stage is Stage.FIRST_TOKEN:
            self.time_to_first_token.observe(seconds)
        elif stage is Stage.REQUEST:
            self._request(seconds, attributes)

    def count(self, count: Count, n: float, kind: str) -> None:
        """The counter a count adds to (shared/observe.py)."""
        counter = self._counters.get(count)
        if counter is not None:
            counter.inc(n)
            return
        if not kind:
            raise ValueError(f"count {count} needs its kind (a reason, section or result)")
        self._counters_by_kind[count].labels(kind).inc(n)

    def _request(self, seconds: float, attributes: Attributes) -> None:
        status = str(attributes[STATUS])
        counted = self.requests_of.get(status)
        (counted if counted is not None else self.requests.labels(status=status)).inc()
        if status == "OK":
            self.request_duration.observe(seconds)
        reason = attributes.get(FAILURE_REASON)
        if reason is not None:
            self.failures.labels(reason=str(reason)).inc()

    def _transfer(self, seconds: float, attributes: Attributes) -> None:
        moved = self.transferred_bytes_of
        moved["fa"].inc(number(attributes, TRANSFER_ATTENTION_BYTES))
        moved["conv"].inc(number(attributes, TRANSFER_CONV_BYTES))
        moved["ssm"].inc(number(attributes, TRANSFER_SSM_BYTES))
        self.transfer_seconds.observe(seconds)
        for posting in numbers(attributes, TRANSFER_POST_SECONDS):
            self.post_seconds.observe(posting)
        self.descriptors_per_read.observe(number(attributes, TRANSFER_DESCRIPTORS) / number(attributes, TRANSFER_READS))

    def exposition(self) -> str:
        """The Prometheus text format of every metric (tests, debugging)."""
        return generate_latest(self.registry).decode()
