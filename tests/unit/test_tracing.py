"""shared.observe: marks reach the installed sink, and only while it is installed."""

from __future__ import annotations

import pytest

from shared import observe as tracing
from shared.observe import Step


class Recorder:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def mark(self, step: str) -> None:
        self.steps.append(step)


def test_marks_reach_the_sink_only_while_installed() -> None:
    recorder = Recorder()
    tracing.mark(Step.JOB_QUEUED)  # nobody listening: dropped
    with tracing.tracing_into(recorder):
        tracing.mark(Step.JOB_QUEUED)
        tracing.mark(Step.FREED)
    tracing.mark(Step.PINNED)  # uninstalled again
    assert recorder.steps == ["d.job_queued", "p.freed"]


def test_one_sink_at_a_time_and_uninstalled_after_an_error() -> None:
    with pytest.raises(ValueError), tracing.tracing_into(Recorder()):
        with pytest.raises(RuntimeError, match="already installed"), tracing.tracing_into(Recorder()):
            pass
        raise ValueError("the traced block failed")
    recorder = Recorder()
    with tracing.tracing_into(recorder):  # the failed block left nothing installed
        tracing.mark(Step.IDS)
    assert recorder.steps == ["d.ids"]


def test_step_names_are_unique_and_name_their_thread() -> None:
    values = [s.value for s in Step]
    assert len(set(values)) == len(values)
    assert all(v.split(".", 1)[0] in {"d", "p", "o", "c"} for v in values)
