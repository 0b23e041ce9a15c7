"""OpenAI response objects (completion, chat.completion and their stream chunks), as dicts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True)
class Header:
    """What every object and chunk of one response repeats."""

    id: str
    model: str
    created: int

    @classmethod
    def new(cls, id: str, model: str) -> Header:
        return cls(id, model, int(time.time()))

    def fields(self, object_name: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(h: Header, choices: list[dict[str, Any]], usage: Usage, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body = h.fields("text_completion") | {"choices": choices, "usage": usage.to_json()}
    return body | (extra or {})


def completion_chunk(
    h: Header,
    text: str,
    finish_reason: str | None,
    with_usage: bool,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body = h.fields("text_completion") | {"choices": [completion_choice(index, text, finish_reason, logprobs)]}
    return body | ({"usage": None} if with_usage else {})


def chat_choice(index: int, text: str, finish_reason: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(h: Header, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return h.fields("chat.completion") | {"choices": choices, "usage": usage.to_json()}


def chat_chunk(
    h: Header,
    delta: dict[str, Any],
    finish_reason: str | None,
    with_usage: bool,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body = h.fields("chat.completion.chunk") | {
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    }
    return body | ({"usage": None} if with_usage else {})


def usage_chunk(h: Header, object_name: str, usage: Usage) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage`: no choices, the usage."""
    return h.fields(object_name) | {"choices": [], "usage": usage.to_json()}


def model_list(model_ids: list[str], created: int, max_model_len: int, owner: str = "hybrid-pd") -> dict[str, Any]:
    """`max_model_len` as vLLM reports it: here, the most tokens (prompt + generated) one request can hold."""
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": created, "owned_by": owner, "root": m, "max_model_len": max_model_len}
            for m in model_ids
        ],
    }
