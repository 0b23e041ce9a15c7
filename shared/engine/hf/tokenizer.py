"""Text <-> token ids with a checkpoint's own tokenizer (loaded offline by AutoTokenizer).

`stream()` gives the same feed/finish interface as decode_svc's byte StreamDecoder: a BPE token
need not end on a character boundary, so text is emitted once the ids decoded so far end in a
whole character.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"  # what decode() shows for an incomplete UTF-8 sequence


class HfTokenizer:
    def __init__(self, directory: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok: Any = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{directory}: cannot load the checkpoint's tokenizer: {e}") from None

    def encode(self, text: str) -> list[int]:
        """The prompt's ids as the model was trained on them (no special tokens added)."""
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> HfStreamDecoder:
        return HfStreamDecoder(self)


class HfStreamDecoder:
    """Incremental text of a growing id sequence (decodes the whole sequence each time: simple,
    and cheap next to a model step at the lengths one request reaches)."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def feed(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        text = self._tokenizer.decode(self._ids)
        if text.endswith(_REPLACEMENT):
            return ""  # wait for the rest of the character
        return self._take(text)

    def finish(self) -> str:
        return self._take(self._tokenizer.decode(self._ids))

    def _take(self, text: str) -> str:
        new, self._emitted = text[self._emitted :], max(self._emitted, len(text))
        return new
