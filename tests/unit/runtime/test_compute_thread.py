"""ComputeThread keeps the executor's contract: one thread, calls in order, results and exceptions
delivered to the awaiting task, a call cancelled before it started never runs, shutdown cancels
what is queued and lets the running call finish."""

from __future__ import annotations

import asyncio
import threading

import pytest

from shared.runtime.compute_thread import ComputeThread


def gate() -> tuple[threading.Event, threading.Event]:
    """(started, release): a call that sets `started` and blocks until `release`."""
    return threading.Event(), threading.Event()


@pytest.mark.asyncio
async def test_calls_run_in_order_on_one_named_thread() -> None:
    worker = ComputeThread("ordered")
    seen: list[tuple[int, str]] = []
    try:
        futures = [worker.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(20)]
        await asyncio.gather(*futures)
    finally:
        worker.shutdown(wait=True)
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"ordered_0"}
    assert threading.current_thread().name != "ordered_0"  # not the loop's thread


@pytest.mark.asyncio
async def test_result_and_exception_reach_the_awaiting_task() -> None:
    worker = ComputeThread("results")

    def fails() -> int:
        raise KeyError("from the compute thread")

    try:
        assert await worker.submit(lambda: 6 * 7) == 42
        with pytest.raises(KeyError, match="from the compute thread"):
            await worker.submit(fails)
        assert await worker.submit(lambda: "still running") == "still running"
    finally:
        worker.shutdown(wait=True)


@pytest.mark.asyncio
async def test_a_call_cancelled_before_it_started_never_runs() -> None:
    worker = ComputeThread("cancels")
    started, release = gate()
    ran: list[str] = []
    try:
        blocker = worker.submit(lambda: (started.set(), release.wait(10), ran.append("blocker")))
        await asyncio.to_thread(started.wait, 10)
        cancelled = worker.submit(lambda: ran.append("cancelled"))
        kept = worker.submit(lambda: ran.append("kept"))  # negative control: queued the same way, not cancelled
        assert cancelled.cancel()
        release.set()
        await blocker
        await kept
    finally:
        worker.shutdown(wait=True)
    assert ran == ["blocker", "kept"]


@pytest.mark.asyncio
async def test_a_started_call_runs_to_its_end_when_its_future_is_cancelled() -> None:
    worker = ComputeThread("runs-on")
    started, release = gate()
    ran: list[str] = []
    try:
        running = worker.submit(lambda: (started.set(), release.wait(10), ran.append("ran")))
        await asyncio.to_thread(started.wait, 10)
        running.cancel()
        release.set()
        await worker.submit(lambda: None)  # the next call runs only after the first ended
    finally:
        worker.shutdown(wait=True)
    assert ran == ["ran"] and running.cancelled()


@pytest.mark.asyncio
async def test_shutdown_cancels_queued_calls_and_lets_the_running_one_finish() -> None:
    worker = ComputeThread("shuts")
    started, release = gate()
    ran: list[str] = []
    running = worker.submit(lambda: (started.set(), release.wait(10), ran.append("running")))
    await asyncio.to_thread(started.wait, 10)
    queued = worker.submit(lambda: ran.append("queued"))
    worker.shutdown()
    release.set()
    await running
    with pytest.raises(asyncio.CancelledError):
        await queued
    await asyncio.to_thread(worker.shutdown, wait=True)
    assert ran == ["running"]
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)


def test_refuses_a_count_below_one() -> None:
    with pytest.raises(ValueError, match="intra-op threads"):
        ComputeThread("bad", intra_op_threads=0)
