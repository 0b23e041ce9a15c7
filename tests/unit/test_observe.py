"""shared.observe: a stage reaches its observer's own sinks and the process-wide ones, once each,
and a service's metrics take it into the series they always had."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from decode_svc.responses import ClientStream
from decode_svc.tokenizer import StreamDecoder
from shared import observe
from shared.observe import (
    BATCH_SIZE,
    ERROR_MESSAGE,
    FAILURE_REASON,
    RELEASE_REASON,
    STATUS,
    TOKENS,
    Attributes,
    Count,
    Observer,
    Sink,
    Stage,
    Step,
)
from shared.otel import spans
from shared.telemetry import Telemetry


class Recorder(Sink):
    def __init__(self) -> None:
        self.stages: list[tuple[Stage, float, dict[str, object]]] = []
        self.marks: list[Step] = []
        self.counts: list[tuple[Count, float, str]] = []

    def stage(self, stage: Stage, seconds: float, attributes: Attributes, within: Context | None) -> None:
        self.stages.append((stage, seconds, dict(attributes)))

    def mark(self, step: Step) -> None:
        self.marks.append(step)

    def count(self, count: Count, n: float, kind: str) -> None:
        self.counts.append((count, n, kind))


@pytest.fixture
def process_sink() -> Iterator[Recorder]:
    recorder = Recorder()
    observe.add(recorder)
    try:
        yield recorder
    finally:
        observe.remove(recorder)


def test_nothing_listens_until_a_sink_is_installed() -> None:
    assert not observe.listening() and not Observer().listening()
    observe.stage(Stage.READ, 1.0)  # nobody: dropped, no error
    observe.mark(Step.IDS)
    recorder = Recorder()
    assert Observer(recorder).listening()
    observe.add(recorder)
    observe.add(recorder)  # twice is still once
    assert observe.listening()
    observe.mark(Step.IDS)
    observe.remove(recorder)
    observe.mark(Step.BYTES)
    assert recorder.marks == [Step.IDS] and not observe.listening()


def test_a_stage_reaches_its_own_sinks_and_the_process_sinks_once(process_sink: Recorder) -> None:
    own, other = Recorder(), Recorder()
    Observer(own).stage(Stage.DECODE_STEP, 0.5, {BATCH_SIZE: 3})
    Observer(other).stage(Stage.QUEUE_WAIT, 0.25)
    observe.stage(Stage.READ, 0.125, {"k": 1})  # process-wide only
    assert own.stages == [(Stage.DECODE_STEP, 0.5, {BATCH_SIZE: 3})]
    assert other.stages == [(Stage.QUEUE_WAIT, 0.25, {})]
    assert process_sink.stages == [*own.stages, *other.stages, (Stage.READ, 0.125, {"k": 1})]


def test_metrics_observe_the_steps_stages() -> None:
    telemetry = Telemetry("prefill")
    Observer(telemetry).stage(Stage.PREFILL_STEP, 0.5, {BATCH_SIZE: 2, TOKENS: 96})
    Observer(telemetry).stage(Stage.DECODE_STEP, 0.5, {BATCH_SIZE: 4})  # decode's: not exported by prefill
    text = telemetry.exposition()
    assert "hybrid_pd_prefill_batch_size_sum 2.0" in text and "hybrid_pd_prefill_batch_tokens_sum 96.0" in text
    assert "hybrid_pd_prefill_step_seconds_count 1.0" in text
    assert "hybrid_pd_decode_batch_size" not in text
    [batch_sizes] = telemetry.decode_batch_size.collect()
    sums = [s.value for s in batch_sizes.samples if s.name.endswith("_sum")]
    assert sums == [4.0]  # counted all the same, unregistered (shared/telemetry.py)


def test_a_stage_without_the_attributes_its_metrics_need_names_the_attribute() -> None:
    with pytest.raises(KeyError, match=TOKENS):
        Telemetry("prefill").stage(Stage.PREFILL_STEP, 0.5, {BATCH_SIZE: 2}, None)
    with pytest.raises(TypeError, match=BATCH_SIZE):
        Telemetry("decode").stage(Stage.DECODE_STEP, 0.5, {BATCH_SIZE: "four"}, None)


def test_a_release_counts_its_reason_and_is_the_breakdowns_freed_step() -> None:
    telemetry, steps = Telemetry("prefill"), Steps()
    with observe.tracing_into(steps):
        Observer(telemetry).stage(Stage.RELEASE, 0.5, {RELEASE_REASON: "read"})
        Observer(telemetry).stage(Stage.RELEASE, 0.5, {RELEASE_REASON: "lease_expired"})
        Observer(telemetry).stage(Stage.READ, 0.5)  # no step of its own
    text = telemetry.exposition()
    assert 'hybrid_pd_pins_ended_total{reason="read"} 1.0' in text
    assert 'hybrid_pd_pins_ended_total{reason="lease_expired"} 1.0' in text
    assert "hybrid_pd_lease_expiries_total 1.0" in text
    assert steps.steps == [Step.FREED, Step.FREED]


def test_a_wait_for_blocks_is_the_breakdowns_allocated_step() -> None:
    telemetry, steps = Telemetry("prefill"), Steps()
    with observe.tracing_into(steps):
        Observer(telemetry).stage(Stage.QUEUE_WAIT, 0.5)
        Observer(telemetry).stage(Stage.PREFILL_STEP, 0.5, {BATCH_SIZE: 1, TOKENS: 16})  # no step of its own
    assert steps.steps == [Step.ALLOCATED]
    assert "hybrid_pd_queue_wait_seconds_count 1.0" in telemetry.exposition()


def test_a_requests_end_counts_its_status_its_duration_when_ok_and_its_failure_reason() -> None:
    telemetry = Telemetry("decode")
    observer = Observer(telemetry)
    observer.stage(Stage.REQUEST, 0.5, {STATUS: "OK"})
    observer.stage(Stage.REQUEST, 0.25, {STATUS: "UNAVAILABLE", FAILURE_REASON: "PEER_UNAVAILABLE", ERROR_MESSAGE: "gone"})
    observer.stage(Stage.REQUEST, 0.25, {STATUS: "INTERNAL", ERROR_MESSAGE: "no reason of its own"})
    observer.stage(Stage.REQUEST, 0.25, {STATUS: "UNKNOWN"})  # a status not created in advance
    text = telemetry.exposition()
    for status in ("OK", "UNAVAILABLE", "INTERNAL", "UNKNOWN"):
        assert f'hybrid_pd_requests_total{{status="{status}"}} 1.0' in text
    assert 'hybrid_pd_requests_total{status="CANCELLED"} 0.0' in text  # negative control: only what ended
    assert "hybrid_pd_request_duration_seconds_count 1.0" in text and "hybrid_pd_request_duration_seconds_sum 0.5" in text
    assert 'hybrid_pd_failures_total{reason="PEER_UNAVAILABLE"} 1.0' in text
    assert 'hybrid_pd_failures_total{reason="READ_FAILED"} 0.0' in text
    with pytest.raises(KeyError, match=STATUS):
        observer.stage(Stage.REQUEST, 0.5, {})


def test_the_first_token_and_later_chunks_feed_ttft_and_inter_token_latency() -> None:
    telemetry = Telemetry("decode")
    observer = Observer(telemetry)
    observer.stage(Stage.FIRST_TOKEN, 0.5)
    observer.stage(Stage.TOKENS, 0.5, {TOKENS: 4})  # four gaps of an eighth each
    observer.stage(Stage.TOKENS, 0.125, {TOKENS: 1})
    text = telemetry.exposition()
    assert "hybrid_pd_time_to_first_token_seconds_count 1.0" in text
    assert "hybrid_pd_time_to_first_token_seconds_sum 0.5" in text
    assert "hybrid_pd_inter_token_latency_seconds_count 5.0" in text
    assert "hybrid_pd_inter_token_latency_seconds_sum 0.625" in text
    assert 'hybrid_pd_inter_token_latency_seconds_bucket{le="0.1"} 0.0' in text  # negative control: no gap is 1/16
    assert 'hybrid_pd_inter_token_latency_seconds_bucket{le="0.25"} 5.0' in text


def test_a_stream_reports_its_first_token_once_when_it_leaves(process_sink: Recorder) -> None:
    stream = ClientStream(StreamDecoder(), time.monotonic(), Observer(), interval=2)
    fork = ClientStream(StreamDecoder(), time.monotonic(), None, index=1, interval=2)
    assert stream.step(104, None, None) is not None  # the first token goes out alone, at once
    assert stream.step(105, None, None) is None  # held for --stream-interval 2
    assert stream.step(106, None, None) is not None
    assert fork.step(104, None, None) is not None  # a fork's first token: sequence 0's is the request's
    assert [name for name, _, _ in process_sink.stages] == [Stage.FIRST_TOKEN]


def test_counts_reach_the_sinks_and_the_counters_they_name(process_sink: Recorder) -> None:
    decode, prefill = Telemetry("decode"), Telemetry("prefill")
    Observer(decode).count(Count.PREFIX_CACHE_HIT)
    Observer(decode).count(Count.PREFIX_CACHE_EVICTED, 3)
    Observer(decode).count(Count.DIGEST_MISMATCH, kind="ssm")
    Observer(prefill).count(Count.BOUNDARY_SKIPPED_TOKENS, 64)
    Observer(prefill).count(Count.HANDSHAKE, kind="ok")
    assert process_sink.counts == [
        (Count.PREFIX_CACHE_HIT, 1, ""),
        (Count.PREFIX_CACHE_EVICTED, 3, ""),
        (Count.DIGEST_MISMATCH, 1, "ssm"),
        (Count.BOUNDARY_SKIPPED_TOKENS, 64, ""),
        (Count.HANDSHAKE, 1, "ok"),
    ]
    text = decode.exposition()
    assert "hybrid_pd_prefix_cache_hits_total 1.0" in text and "hybrid_pd_prefix_cache_evictions_total 3.0" in text
    assert "hybrid_pd_prefix_cache_misses_total 0.0" in text  # negative control: a hit is not a miss
    assert 'hybrid_pd_digest_mismatches_total{section="ssm"} 1.0' in text
    assert 'hybrid_pd_digest_mismatches_total{section="fa"} 0.0' in text
    text = prefill.exposition()
    assert "hybrid_pd_prefill_boundary_skipped_tokens_total 64.0" in text
    assert 'hybrid_pd_handshakes_total{result="ok"} 1.0' in text
    assert "hybrid_pd_prefix_cache" not in text  # decode's: not exported by prefill


def test_every_count_has_a_counter_and_one_counted_by_kind_needs_its_kind() -> None:
    telemetry = Telemetry("decode")
    for count in Count:
        telemetry.count(count, 1, "a_kind")  # a counter each, none missing
    with pytest.raises(ValueError, match=Count.PREFILL_RETRY.value):
        telemetry.count(Count.PREFILL_RETRY, 1, "")


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    spans.install(provider)
    try:
        yield memory
    finally:
        spans.uninstall()
        provider.shutdown()


def test_a_requests_end_ends_the_span_it_was_reported_within(exporter: InMemorySpanExporter) -> None:
    request, other = spans.start("request"), spans.start("other")
    assert request is not None and other is not None
    with trace.use_span(other):  # current, yet not the request's span: left open
        observe.stage(Stage.MANIFEST, 0.5, {"hybrid_pd.computed_tokens": 4})
        ended = {STATUS: "UNAVAILABLE", FAILURE_REASON: "PEER_UNAVAILABLE", ERROR_MESSAGE: "prefill gone"}
        observe.stage(Stage.REQUEST, 0.5, ended, within=trace.set_span_in_context(request))
        observe.stage(Stage.REQUEST, 0.5, {STATUS: "OK"})  # negative control: no span kept, none ended
    [finished] = exporter.get_finished_spans()
    assert finished.name == "request" and finished.status.status_code == StatusCode.ERROR
    assert finished.status.description == "UNAVAILABLE: prefill gone"
    attributes = dict(finished.attributes or {})
    assert attributes == {STATUS: "UNAVAILABLE", FAILURE_REASON: "PEER_UNAVAILABLE"}  # the message is the status's
    other.end()
    [_, still_open] = exporter.get_finished_spans()
    assert [(e.name, dict(e.attributes or {})) for e in still_open.events] == [(spans.MANIFEST, {"hybrid_pd.computed_tokens": 4})]


class Steps:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def mark(self, step: str) -> None:
        self.steps.append(step)
