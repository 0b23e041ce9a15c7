"""Repeated identical warnings, at most one per key per window (a decode pointed at a dead
prefill would otherwise log the same line on every reconnect attempt).

The key is the logger, the level and the message text; the first line of a key passes, the
repeats within `window` seconds are dropped and counted, and the next line that passes says how
many were suppressed. INFO and DEBUG lines are never limited."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

DEFAULT_WINDOW_SECONDS = 30.0
MAX_KEYS = 1024  # distinct messages remembered; the oldest are forgotten beyond this


class RateLimitFilter(logging.Filter):
    def __init__(self, window: float = DEFAULT_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window = window
        self.clock = clock
        self._seen: dict[tuple[str, int, str], tuple[float, int]] = {}  # key -> (passed at, suppressed since)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, record.getMessage())
        now = self.clock()
        passed = self._seen.get(key)
        if passed is not None and now - passed[0] < self.window:
            self._seen[key] = (passed[0], passed[1] + 1)
            return False
        suppressed = passed[1] if passed is not None else 0
        self._seen.pop(key, None)
        self._seen[key] = (now, 0)
        if len(self._seen) > MAX_KEYS:
            del self._seen[next(iter(self._seen))]
        if suppressed:
            record.msg = f"{record.getMessage()} ({suppressed} identical lines suppressed in the last {self.window:g}s)"
            record.args = None
        return True
