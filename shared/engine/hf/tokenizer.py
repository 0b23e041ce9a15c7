"""Text <-> token ids with a checkpoint's own tokenizer (loaded offline by AutoTokenizer).

`stream()` gives the same feed/finish interface as decode_svc's byte StreamDecoder, on the
tokenizers library's own DecodeStream: a BPE (or byte) token need not end on a character
boundary, so a character split across tokens is emitted once whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.engine.hf.chat_template import HfChatTemplate, checkpoint_chat_template
from shared.logs.third_party import transformers_module


class HfTokenizer:
    def __init__(self, directory: str) -> None:
        try:
            self._tok: Any = transformers_module().AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{directory}: cannot load the checkpoint's tokenizer: {e}") from None
        self.chat_template: HfChatTemplate | None = checkpoint_chat_template(self._tok)

    def encode(self, text: str) -> list[int]:
        """The prompt's ids as the model was trained on them (no special tokens added)."""
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def stream(self) -> HfStreamDecoder:
        return HfStreamDecoder(self)


class HfStreamDecoder:
    """Incremental text of a growing id sequence. `finish()` returns what DecodeStream still
    holds (an incomplete character at the end), as the full decode renders it."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._backend = tokenizer._tok.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._emitted = ""

    def feed(self, ids: Sequence[int]) -> str:
        out = []
        for token in ids:
            self._ids.append(int(token))
            piece = self._stream.step(self._backend, int(token))
            if piece:
                out.append(piece)
        text = "".join(out)
        self._emitted += text
        return text

    def finish(self) -> str:
        full = self._tokenizer.decode(self._ids)
        tail = full[len(self._emitted) :] if full.startswith(self._emitted) else ""
        self._emitted += tail
        return tail
