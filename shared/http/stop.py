"""Stop sequences over streamed text (pure).

The output ends before the stop sequence that completes first (as a stream is read, character
by character; of several completing at the same character, the longest), which is not included.
This does not depend on how the text is split into pieces. While streaming, text that could
still be the start of a stop sequence is held back until the next piece decides it.

min_tokens: text fed unarmed (its tokens come before the min_tokens-th) ends nothing: only a
match that ends in text fed armed counts (vLLM checks stop strings from min_tokens tokens on).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self._ends_from = 0  # a match must end after this many pending characters (fed unarmed)
        self.stopped = False

    def feed(self, text: str, *, armed: bool = True) -> str:
        """The text that can be emitted now; after a match, `stopped` is True and the rest is dropped.
        Unarmed (before min_tokens), `text` is never the end of a match."""
        if self.stopped:
            return ""
        self._pending += text
        # Held-back text matched nothing, so every match ends in the new text (and, unarmed, none counts).
        matches = [(e, i) for e, i in (self._first_end(s) for s in self.stops) if i >= 0] if armed else []
        if matches:
            _, cut = min(matches)
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = self._held_length()
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep :]
        # Unarmed, none of the kept text may end a match; armed, what was unarmed still may not.
        self._ends_from = max(0, self._ends_from - len(out)) if armed else len(self._pending)
        return out

    def _first_end(self, stop: str) -> tuple[int, int]:
        """(end, start) of the first occurrence of `stop` ending after `_ends_from`; start -1: none."""
        i = self._pending.find(stop, max(0, self._ends_from - len(stop) + 1))
        return i + len(stop), i

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
