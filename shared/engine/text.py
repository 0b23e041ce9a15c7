"""Text <-> token ids as the services need them: an engine with its own tokenizer (a checkpoint's)
offers one of these; the others use the services' byte tokenizer (decode_svc/tokenizer.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TextStream(Protocol):
    """Incremental text of a growing id sequence: never emits half a character."""

    def feed(self, ids: Sequence[int]) -> str: ...

    def finish(self) -> str:
        """What is still held back at the end (an incomplete character, as the full decode shows it)."""
        ...


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream(self) -> TextStream: ...
