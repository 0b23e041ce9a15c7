"""The one thread that owns a NIXL agent: runs its calls in order, and pumps it in between.

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
                self._run_after_job()
            interval = self._interval()
            if interval is not None and time.monotonic() - last_pump >= interval:
                last_pump = time.monotonic()
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

    @staticmethod
    def _run(job: _Job) -> None:
        future, fn, args = job
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # delivered to the caller, not lost in this thread
            future.set_exception(exc)
