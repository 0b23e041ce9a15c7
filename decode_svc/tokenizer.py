"""Text <-> token ids for Generate: the engine's own tokenizer when it has one (a checkpoint's,
`--engine hf`), else UTF-8 bytes, the byte-level tokenizer of the reference models.

Engines with a larger vocabulary (the synthetic engine at real-model sizes) may emit ids of
256 and above; they have no text and render as nothing. Streaming uses an incremental decoder
so a character split across two chunks is emitted whole with the second one.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from shared.engine.protocol import Engine
from shared.engine.text import Tokenizer

BYTE_VOCAB = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class StreamDecoder:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(i for i in ids if i < BYTE_VOCAB))

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return StreamDecoder()


BYTES = ByteTokenizer()


def for_engine(engine: Engine) -> Tokenizer:
    return engine.tokenizer or BYTES
