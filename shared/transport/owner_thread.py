"""The one thread that owns a NIXL agent: runs its calls in order, and pumps it in between.

A short call may instead run on the caller's thread while this one is idle (`try_inline`):
a lock held by this thread around each call and pump keeps the agent to one thread at a time.

Pumping from this thread instead of from the event loop matters on small machines: a
1 ms asyncio tick that hops to a worker thread cost 20-27 % of a core per busy
process here (two event-loop wake-ups and a thread hop per tick), the same pump
on the owner thread ~4-5 %; and the event loop is only woken when something happened.
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


class OwnerThread:
    """Runs submitted calls one at a time; between them runs `pump` every `interval()` seconds.

    `interval()` is asked again after every call and pump: None means do not pump.
    """

    def __init__(self, name: str, pump: Callable[[], None], interval: Callable[[], float | None]) -> None:
        self._jobs: queue.SimpleQueue[_Job | object] = queue.SimpleQueue()
        # Held by this thread while it runs a call or pumps; `try_inline` takes it from another
        # thread only when free, so the agent is never used by two threads at once.
        self._busy = threading.Lock()
        self._pump = pump
        self._interval = interval
        self._after_job: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        # Daemon: an agent nobody closed must not keep the interpreter alive at exit.
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

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
            self._busy.release()

    def stop(self) -> None:
        """Finish the calls already queued, then end the thread."""
        self._jobs.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _main(self) -> None:
        last_pump = time.monotonic()
        while True:
            interval = self._interval()
            timeout = None if interval is None else max(0.0, last_pump + interval - time.monotonic())
            try:
                job = self._jobs.get(timeout=timeout)
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            if job is not None:
                self._run(job)  # type: ignore[arg-type]
                if self._after_job:
                    with self._busy:
                        self._run_after_job()
            interval = self._interval()
            if interval is not None and time.monotonic() - last_pump >= interval:
                last_pump = time.monotonic()
                with self._busy:
                    try:
                        self._pump()
                    except Exception:
                        log.exception("pumping the NIXL agent on %s failed", self._thread.name)
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
