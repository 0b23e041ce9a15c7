"""Where a chunked prefill cuts the prompt: at multiples of the chunk size, so the chunks, and
with them an engine's rounding (the hf engine's), do not depend on who computes (a prefill
service sending manifest parts, or one forward loop in a colocated run)."""

from __future__ import annotations


def chunk_ends(start: int, stop: int, chunk_tokens: int) -> list[int]:
    """Ends of the chunks that compute tokens [start, stop): every multiple of `chunk_tokens`
    inside, then `stop` (`chunk_tokens` 0: one chunk)."""
    if stop <= start:
        return []
    if chunk_tokens <= 0:
        return [stop]
    return [*range((start // chunk_tokens + 1) * chunk_tokens, stop, chunk_tokens), stop]
