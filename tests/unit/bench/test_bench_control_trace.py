"""StepTrace: steps run from a request's first `from` mark to its last `to` mark."""

from __future__ import annotations

import threading
import time

from pytest import MonkeyPatch

from hybridpd_tools.bench import control_trace
from hybridpd_tools.bench.control_trace import STEPS, StepTrace


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


def _nothing() -> None:
    return None


def _calls_between_two_marks(extra: int) -> tuple[int, int]:
    counter = control_trace.CallCounter()
    trace = StepTrace(counter=counter)
    _, start, stop = STEPS[0]
    with counter.counting():
        trace.begin()
        trace.mark(start)
        for _ in range(extra):
            _nothing()
        trace.mark(stop)
        trace.end()
    [calls] = trace.call_samples()[STEPS[0][0]]
    return calls


def test_call_counts_between_marks_are_exact() -> None:
    base_python, base_c = _calls_between_two_marks(0)  # the marks' own calls: the same every time
    assert _calls_between_two_marks(0) == (base_python, base_c)
    # Seven more Python calls, no more C calls (the negative control: the counts do move).
    assert _calls_between_two_marks(7) == (base_python + 7, base_c)


def test_loop_cpu_only_for_steps_marked_on_the_loop_thread() -> None:
    on_loop, off_loop = STEPS[0], STEPS[3]  # job over the stream; prefill's hop to the compute thread
    trace = StepTrace()
    trace.begin()
    trace.mark(on_loop[1])
    spent = time.thread_time() + 0.002
    while time.thread_time() < spent:  # CPU on this (the loop's) thread between the marks
        pass
    trace.mark(on_loop[2])
    trace.mark(off_loop[1])
    other = threading.Thread(target=trace.mark, args=(off_loop[2],))  # the compute thread's mark
    other.start()
    other.join()
    trace.end()
    cpu = trace.loop_cpu_samples()
    assert len(cpu[on_loop[0]]) == 1 and cpu[on_loop[0]][0] >= 0.002
    assert cpu[off_loop[0]] == [] and len(trace.step_samples()[off_loop[0]]) == 1  # wall clock only
    assert trace.call_samples()[on_loop[0]] == []  # no counter: no counts
    summaries = {s["step"]: s for s in trace.summaries_ms()}
    assert summaries[on_loop[0]]["loop_cpu_us"]["count"] == 1 and summaries[on_loop[0]]["loop_cpu_us"]["p10"] >= 2000
    assert summaries[off_loop[0]]["loop_cpu_us"] == {"count": 0, "p10": None, "median": None}


def test_call_summary_shape() -> None:
    assert control_trace.call_summary([(10, 4), (12, 6), (11, 5)]) == {
        "count": 3,
        "python_mean": 11.0,
        "python_median": 11,
        "c_mean": 5.0,
        "c_median": 5,
    }
    assert control_trace.call_summary([])["python_mean"] is None
