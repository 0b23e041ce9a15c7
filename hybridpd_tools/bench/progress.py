"""A simple progress bar on stderr for anything that runs longer than a few seconds.

On a terminal it redraws one line; otherwise (logs, CI) it prints a line at most every few
seconds, so piped output stays short. stdout is left alone: it carries tables and JSON.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

WIDTH = 28
PLAIN_INTERVAL_SECONDS = 5.0


class Progress:
    def __init__(self, label: str, total: int, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.total = max(1, total)
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._started = time.monotonic()
        self._last_plain = 0.0
        self._printed = -1  # `done` when a plain line was last printed

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.finish()

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + steps)
        self._draw(note=note)

    def finish(self) -> None:
        if not self.enabled:
            return
        self._draw(force=True)
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
        self.enabled = False

    def line(self, note: str = "") -> str:
        filled = WIDTH * self.done // self.total
        elapsed = time.monotonic() - self._started
        bar = "#" * filled + "." * (WIDTH - filled)
        text = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s"
        return f"{text} {note}" if note else text

    def _draw(self, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._tty:
            self.stream.write("\r" + self.line(note) + "\x1b[K")
        elif self.done != self._printed and (
            force or self.done == self.total or now - self._last_plain >= PLAIN_INTERVAL_SECONDS
        ):
            self.stream.write(self.line(note) + "\n")
            self._last_plain = now
            self._printed = self.done
        else:
            return
        self.stream.flush()
