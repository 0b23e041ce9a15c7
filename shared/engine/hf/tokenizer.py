"""Text <-> token ids with a checkpoint's own tokenizer (loaded offline by AutoTokenizer)."""

from __future__ import annotations

from typing import Any, Sequence


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
