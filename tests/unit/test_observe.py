"""shared.observe: a stage reaches its observer's own sinks and the process-wide ones, once each,
and a service's metrics take it into the series they always had."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.context import Context

from shared import observe
from shared.observe import BATCH_SIZE, RELEASE_REASON, TOKENS, Attributes, Observer, Sink, Stage, Step
from shared.telemetry import Telemetry


class Recorder(Sink):
    def __init__(self) -> None:
        self.stages: list[tuple[Stage, float, dict[str, object]]] = []
        self.marks: list[Step] = []

    def stage(self, stage: Stage, seconds: float, attributes: Attributes, within: Context | None) -> None:
        self.stages.append((stage, seconds, dict(attributes)))

    def mark(self, step: Step) -> None:
        self.marks.append(step)


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


class Steps:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def mark(self, step: str) -> None:
        self.steps.append(step)
