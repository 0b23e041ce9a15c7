"""The one thread that runs an engine's model calls, awaited from the event loop.

`loop.run_in_executor` on a ThreadPoolExecutor wraps each call in a concurrent.futures Future and
chains it to an asyncio one, which costs the event loop many Python calls per model call (most of
them the Future's lock taken and released). Here a call is a queue entry and an asyncio future the thread settles
with one `call_soon_threadsafe`. Same contract as the executor: calls run one at a time in order,
the thread's torch thread count is set before its first op (compute_threads), a future cancelled
before its call started keeps the call from running, a call once started runs to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from shared.engine.compute_threads import DEFAULT_INTRA_OP_THREADS, pin_intra_op_threads

T = TypeVar("T")

_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]


class ComputeThread:
    """Runs `submit`ted calls one at a time on a thread of its own, started at the first call."""

    def __init__(self, name: str, intra_op_threads: int = DEFAULT_INTRA_OP_THREADS) -> None:
        if intra_op_threads < 1:
            raise ValueError(f"intra-op threads must be >= 1, got {intra_op_threads}")
        self._name = name
        self._intra_op_threads = intra_op_threads
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()  # start and shutdown only, never per call

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue `fn` now; the future, of the running loop, gets its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if self._thread is None:
            self._start()
        if self._closed:
            raise RuntimeError(f"compute thread {self._name} is shut down")
        self._jobs.put((loop, future, fn))
        return future

    def shutdown(self, *, wait: bool = False) -> None:
        """Cancel the calls not started yet, let the running one finish, end the thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _deliver(job[0], job[1].cancel)
        self._jobs.put(None)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                # Daemon: a host nobody closed must not keep the interpreter alive at exit.
                self._thread = threading.Thread(target=self._main, name=f"{self._name}_0", daemon=True)
                self._thread.start()

    def _main(self) -> None:
        pin_intra_op_threads(self._intra_op_threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn = job
            del job
            # Read from this thread: a cancel racing with it only loses the call's result, as
            # with an executor's future that started running.
            if not future.cancelled():
                result: Any = None
                error: BaseException | None = None
                try:
                    result = fn()
                except BaseException as exc:  # delivered to the awaiting task, not lost in this thread
                    error = exc
                _deliver(loop, _settle, future, result, error)
                del result, error
            del loop, future, fn


def _deliver(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to await the future
        loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
