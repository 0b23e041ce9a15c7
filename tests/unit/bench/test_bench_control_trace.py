"""StepTrace: steps run from a request's first `from` mark to its last `to` mark."""

from __future__ import annotations

from pytest import MonkeyPatch

from shared.bench import control_trace
from shared.bench.control_trace import STEPS, StepTrace


def test_steps_span_first_start_to_last_stop_and_skip_missing_marks(monkeypatch: MonkeyPatch) -> None:
    clock = iter([1.0, 2.0, 5.0, 10.0, 20.0])
    monkeypatch.setattr(control_trace.time, "perf_counter", lambda: next(clock))
    label, start, stop = STEPS[0]
    trace = StepTrace()
    trace.mark(start)  # outside a request: ignored (no clock read)
    trace.begin()
    trace.mark(start)  # 1.0
    trace.mark(start)  # 2.0 (a second rank): the step still starts at the first
    trace.mark(stop)  # 5.0
    trace.mark(stop)  # 10.0: ends at the last
    trace.end()
    trace.begin()
    trace.mark(start)  # 20.0, never stopped: no sample
    trace.end()
    samples = trace.step_samples()
    assert samples[label] == [9.0]
    assert all(not v for k, v in samples.items() if k != label)
    summary = {s["step"]: s for s in trace.summaries_ms()}[label]
    assert summary["count"] == 1 and summary["median"] == 9000.0
