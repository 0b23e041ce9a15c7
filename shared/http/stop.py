"""Stop sequences over streamed text (pure).

The output ends before the stop sequence that completes first (as a stream is read, character
by character; of several completing at the same character, the longest), which is not included.
This does not depend on how the text is split into pieces. While streaming, text that could
still be the start of a stop sequence is held back until the next piece decides it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that can be emitted now; after a match, `stopped` is True and the rest is dropped."""
        if self.stopped:
            return ""
        self._pending += text
        # Held-back text matched nothing, so every match ends in the new text.
        matches = [(i + len(s), i) for s, i in ((s, self._pending.find(s)) for s in self.stops) if i >= 0]
        if matches:
            _, cut = min(matches)
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = self._held_length()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        return out

    def finish(self) -> str:
        """At the end of generation: what was held back (no stop sequence followed)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_length(self) -> int:
        """Longest tail of the pending text that is a proper prefix of some stop sequence."""
        for n in range(min(self._hold, len(self._pending)), 0, -1):
            tail = self._pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
