"""The one thread that owns a NIXL agent: runs its calls in order, and pumps it in between.

A short call may instead run on the caller's thread while this one is idle (`try_inline`):
a lock held by this thread around each call and pump keeps the agent to one thread at a time.

Pumping from this thread instead of from the event loop matters on small machines: a
1 ms asyncio tick that hops to a worker thread cost 20-27 % of a core per busy
process here (two event-loop wake-ups and a thread hop per tick), the same pump
on the owner thread ~4-5 %; and the event loop is only woken when something happened.

An idle agent should cost nothing, but without NIXL's progress thread there is no event to
block on: NIXL cannot wake this thread when a message arrives, only a pump sees it. So while
pumps find nothing to do, the wait between them doubles, up to `max_idle_wait` (what nobody
waits for, a stray notification, is seen at most that late); a call, or a pump that found work,
brings it back to `interval()` at once. Every wait for real work (READs in flight, notifications
awaited) starts with a call, so it is pumped at its full rate.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

_Job = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...]]
_STOP = object()
_WAKE = object()  # ends a backed-off wait (see try_inline)
MAX_IDLE_WAIT = 1.0  # the longest wait between pumps once idle (seconds)


class OwnerThread:
    """Runs submitted calls one at a time; between them runs `pump` every `interval()` seconds.

    `interval()` is asked again after every call and pump: None means do not pump. `pump`
    returns whether it found work; while it does not, the wait doubles up to `max_idle_wait`.
    """

    def __init__(
        self,
        name: str,
        pump: Callable[[], bool],
        interval: Callable[[], float | None],
        *,
        max_idle_wait: float = MAX_IDLE_WAIT,
    ) -> None:
        self._jobs: queue.SimpleQueue[_Job | object] = queue.SimpleQueue()
        # Held by this thread while it runs a call or pumps; `try_inline` takes it from another
        # thread only when free, so the agent is never used by two threads at once.
        self._busy = threading.Lock()
        self._pump = pump
        self._interval = interval
        self._max_idle_wait = max_idle_wait
        self._idle_pumps = 0  # pumps in a row that found nothing (owner thread; try_inline resets)
        self._after_job: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        # Daemon: an agent nobody closed must not keep the interpreter alive at exit.
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def pump_wait(self) -> float | None:
        """The wait between pumps now: `interval()`, doubled per pump that found nothing."""
        interval = self._interval()
        if interval is None or not self._idle_pumps:
            return interval
        return max(interval, min(interval * 2.0**self._idle_pumps, self._max_idle_wait))

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def after_job(self, fn: Callable[..., Any], *args: Any) -> None:
        """From the job running now (owner thread only): run `fn` right after its caller got
        the result, before the next job. For cleanup the caller need not wait for."""
        self._after_job.append((fn, args))

    def try_inline(self, fn: Callable[..., T], *args: Any) -> tuple[bool, T | None]:
        """Run `fn` on the calling thread right now if this thread is idle (no call queued, none
        running, not pumping): (True, result). Otherwise (False, None) without waiting: submit
        it instead. Exceptions of `fn` propagate to the caller."""
        if not self._jobs.empty() or not self._busy.acquire(blocking=False):
            return False, None
        try:
            return True, fn(*args)
        finally:
            # What the call left for the pump (a message UCX could not send at once) must not
            # wait out a long idle wait: wake a thread backed off past twice its interval. One
            # nearer its interval is left asleep, so a burst of inline calls costs no wake-ups.
            backed_off = self._idle_pumps > 1
            self._busy.release()
            if backed_off:
                self.wake()

    def wake(self) -> None:
        """Pump at the full rate again, as after a call (from any thread)."""
        self._jobs.put(_WAKE)

    def stop(self) -> None:
        """Finish the calls already queued, then end the thread."""
        self._jobs.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _main(self) -> None:
        last_pump = time.monotonic()
        while True:
            wait = self.pump_wait
            timeout = None if wait is None else max(0.0, last_pump + wait - time.monotonic())
            try:
                job = self._jobs.get(timeout=timeout)
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            if job is not None:
                self._idle_pumps = 0  # a call may leave work for the pump: back to the full rate
            if job is not None and job is not _WAKE:
                self._run(job)  # type: ignore[arg-type]
                if self._after_job:
                    with self._busy:
                        self._run_after_job()
            wait = self.pump_wait
            if wait is not None and time.monotonic() - last_pump >= wait:
                last_pump = time.monotonic()
                with self._busy:
                    try:
                        found = self._pump()
                    except Exception:
                        log.exception("pumping the NIXL agent on %s failed", self._thread.name)
                        found = True  # keep the rate: READs may still be tracked
                    self._idle_pumps = 0 if found else min(self._idle_pumps + 1, 64)
                    self._run_after_job()

    def _run_after_job(self) -> None:
        while self._after_job:
            fn, args = self._after_job.pop(0)
            try:
                fn(*args)
            except Exception:
                log.exception("cleanup after a call on %s failed", self._thread.name)

    def _run(self, job: _Job) -> None:
        future, fn, args = job
        if not future.set_running_or_notify_cancel():
            return
        with self._busy:
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # delivered to the caller, not lost in this thread
                result, error = None, exc
        # Delivered after the lock is free: the caller, woken by it, may post inline at once.
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
