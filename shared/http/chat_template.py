"""Chat messages -> one prompt string.

The tiny reference models have a byte tokenizer and no template of their own; they use
`BYTE_TEMPLATE`, documented here so clients can reproduce it:

    <|system|>\\nYou are terse.\\n<|user|>\\nHello\\n<|assistant|>\\n

one `<|role|>\\n{content}\\n` block per message, then `<|assistant|>\\n` (the generation prompt).
A checkpoint's own tokenizer chat template plugs in through the `ChatTemplate` protocol (an
engine that has one exposes it as `engine.chat_template`; see `template_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shared.http.params import ChatMessage


class ChatTemplate(Protocol):
    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text, ending with the assistant's generation prompt."""
        ...


class ByteTemplate:
    def render(self, messages: Sequence[ChatMessage]) -> str:
        blocks = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
        return "".join(blocks) + "<|assistant|>\n"


BYTE_TEMPLATE = ByteTemplate()


def template_for(engine: object) -> ChatTemplate:
    """The engine's own template when it brings one (a checkpoint's tokenizer), else the byte template."""
    own = getattr(engine, "chat_template", None)
    return own if own is not None else BYTE_TEMPLATE
