"""Byte-level tokenizer: token id = UTF-8 byte (256 ids, nothing to download)."""

from __future__ import annotations

from collections.abc import Sequence

VOCAB_SIZE = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    """Bytes back to text; invalid UTF-8 (a generated token stream need not be valid) is replaced."""
    if any(not 0 <= i < VOCAB_SIZE for i in ids):
        raise ValueError(f"token ids must be in [0, {VOCAB_SIZE})")
    return bytes(ids).decode("utf-8", errors="replace")
