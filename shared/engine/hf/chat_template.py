"""A checkpoint's own chat template (its tokenizer's Jinja template) as a `ChatTemplate`.

Renders exactly what transformers' `apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)` gives; the services then encode that text like any prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Message(Protocol):
    """One chat message as the template reads it (the HTTP layer's `ChatMessage` is one): the
    engine knows no HTTP, so it names only the two fields it renders."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


class HfChatTemplate:
    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: a transformers tokenizer that has a `chat_template`."""
        self._tok = tokenizer

    def render(self, messages: Sequence[Message]) -> str:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        return str(self._tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True))


def checkpoint_chat_template(tokenizer: Any) -> HfChatTemplate | None:
    """The tokenizer's template as a `ChatTemplate`, or None when the checkpoint has none."""
    return HfChatTemplate(tokenizer) if getattr(tokenizer, "chat_template", None) else None
