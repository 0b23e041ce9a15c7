"""Validation of OpenAI `/v1/completions` and `/v1/chat/completions` bodies (pure, no I/O).

Every problem raises InvalidArgument naming the JSON field (`param` of the error object).
Unknown fields are ignored, as vLLM does: routers add their own (`min_tokens`,
`kv_transfer_params`, ...). Sampling: greedy unless the body names a temperature above 0 (this
server's default, where OpenAI's is 1); `temperature`, `top_p`, `top_k` (vLLM's extension) and
`seed` reach the engine, and so do vLLM's `stop_token_ids` and `ignore_eos`. Penalties are
validated here and refused by the decode endpoints unless 0 (no engine applies them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared import limits
from shared.errors import InvalidArgument
from shared.limits import FloatRange, IntRange

MAX_STOP_SEQUENCES = 4
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1): off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_p <= 0.0


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class CommonParams:
    model: str | None
    max_tokens: int | None  # None: as many as the request's capacity allows (chat)
    max_tokens_field: str  # which field max_tokens came from, for error messages
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    kv_transfer_params: dict[str, Any] | None
    user: str | None = None
    logprobs: int | None = None  # None: none; k: each token's logprob and the k likeliest
    n: int = 1  # choices, each a sequence of its own from the one prompt


@dataclass(frozen=True)
class CompletionParams(CommonParams):
    prompt: str | list[int] = field(default="")
    best_of: int = 1  # sequences generated; the n of highest cumulative logprob are returned
    echo: bool = False  # the prompt's text first (with logprobs: its logprobs too)


@dataclass(frozen=True)
class ChatParams(CommonParams):
    messages: tuple[ChatMessage, ...] = field(default=())


HTTP_SEQUENCES = IntRange(1, limits.SEQUENCES.high)  # n: 0 is not OpenAI's


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A JSON number that is a finite double (an integer literal beyond any double is not)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _int(body: Mapping[str, Any], name: str, limit: IntRange, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise InvalidArgument(f"must be an integer, got {value!r}", field=name)
    return limit.check(value, name)


def _number(body: Mapping[str, Any], name: str, default: float, limit: FloatRange) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise InvalidArgument(f"must be a number, got {value!r}", field=name)
    return limit.check(value, name)


def _text(value: str, field: str) -> str:
    """Text the tokenizers can encode: JSON's escapes can spell lone UTF-16 surrogates, which
    are no characters and have no UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"is not valid Unicode text ({e.reason} at index {e.start})", field=field) from None
    return value


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"must be true or false, got {value!r}", field=name)
    return value


def _absent_or(body: Mapping[str, Any], name: str, *allowed: object, why: str) -> None:
    """A field whose only supported values are `allowed` (None always allowed)."""
    value = body.get(name)
    if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
        raise InvalidArgument(f"{value!r} is not supported: {why}", field=name)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidArgument("must be a string or a list of strings", field="stop")
    if len(items) > MAX_STOP_SEQUENCES:
        raise InvalidArgument(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(items)}", field="stop")
    if any(s == "" for s in items):
        raise InvalidArgument("stop sequences must not be empty", field="stop")
    return tuple(items)


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    top_k = _int(body, "top_k", limits.HTTP_TOP_K, default=0)
    assert top_k is not None
    return SamplingParams(
        temperature=_number(body, "temperature", 0.0, limits.HTTP_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0, limits.TOP_P),
        top_k=max(top_k, 0),
        seed=_int(body, "seed", limits.HTTP_SEED),
        presence_penalty=_number(body, "presence_penalty", 0.0, limits.PENALTY),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, limits.PENALTY),
    )


def _stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    return tuple(limits.check_token_ids(value, "stop_token_ids"))


def _common(body: Mapping[str, Any], max_tokens: int | None, max_tokens_field: str) -> dict[str, Any]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidArgument(f"must be a string, got {model!r}", field="model")
    n = _int(body, "n", HTTP_SEQUENCES, default=1)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise InvalidArgument("only allowed when stream is true", field="stream_options")
        if not isinstance(options, dict):
            raise InvalidArgument("must be an object", field="stream_options")
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise InvalidArgument("must be true or false", field="stream_options.include_usage")
        include_usage = bool(usage)
    min_tokens = _int(body, "min_tokens", limits.MIN_TOKENS, default=0)
    assert min_tokens is not None
    if max_tokens is not None and min_tokens > max_tokens:
        raise InvalidArgument(f"{min_tokens} is more than {max_tokens_field} ({max_tokens})", field="min_tokens")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise InvalidArgument("must be an object or null", field="kv_transfer_params")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidArgument("must be a string", field="user")
    _absent_or(body, "logit_bias", {}, why="logit_bias is not supported")
    return dict(
        model=model,
        max_tokens=max_tokens,
        max_tokens_field=max_tokens_field,
        min_tokens=min_tokens,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=_bool(body, "ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        sampling=_sampling(body),
        kv_transfer_params=kv,
        user=user,
        n=n,
    )


def _body(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object", field="body")
    return body


def _prompt(value: object) -> str | list[int]:
    """A string or a token id list; a batch of exactly one is unwrapped (n = 1, one prompt)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if value == "":
            raise InvalidArgument("the prompt is empty", field="prompt")
        return _text(value, "prompt")
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        return limits.check_token_ids(value, "prompt")
    if isinstance(value, list) and not value:
        raise InvalidArgument("the prompt is empty", field="prompt")
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise InvalidArgument(f"one prompt per request is supported, got {len(value)}", field="prompt")
    raise InvalidArgument("must be a string or a list of token ids", field="prompt")


def parse_completion(raw: object) -> CompletionParams:
    body = _body(raw)
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidArgument("is required", field="prompt")
    prompt = _prompt(body["prompt"])
    max_tokens = _int(body, "max_tokens", limits.MAX_TOKENS, default=DEFAULT_COMPLETION_MAX_TOKENS)
    _absent_or(body, "suffix", "", why="suffix is not supported")
    logprobs = _int(body, "logprobs", limits.LOGPROBS)
    echo = _bool(body, "echo", False)
    common = _common(body, max_tokens, "max_tokens")
    best_of = _int(body, "best_of", HTTP_SEQUENCES, default=common["n"])
    assert best_of is not None
    if best_of < common["n"]:
        raise InvalidArgument(f"{best_of} is less than n ({common['n']})", field="best_of")
    if best_of > common["n"] and common["stream"]:
        raise InvalidArgument("best_of above n cannot stream (the best are known at the end)", field="best_of")
    return CompletionParams(prompt=prompt, logprobs=logprobs, echo=echo, best_of=best_of, **common)


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list):  # content parts: text only
        parts: list[str] = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(
                    'only text content parts ({"type": "text", "text": ...}) are supported', field=f"{where}[{i}]"
                )
            parts.append(_text(part["text"], f"{where}[{i}].text"))
        return "".join(parts)
    raise InvalidArgument("must be a string or a list of text parts", field=where)


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidArgument("must be a non-empty list of messages", field="messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidArgument("must be an object with role and content", field=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidArgument(f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}", field=f"{where}.role")
        content = message.get("content")
        text = "" if content is None and role == "assistant" else _content(content, f"{where}.content")
        messages.append(ChatMessage(str(role), text))
    return tuple(messages)


def parse_chat(raw: object) -> ChatParams:
    body = _body(raw)
    messages = _messages(body.get("messages"))
    field_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, field_name, limits.MAX_TOKENS)
    _absent_or(body, "best_of", 1, why="chat has no best_of")
    _absent_or(body, "tools", [], why="tool calls are not supported")
    _absent_or(body, "response_format", {"type": "text"}, why="only text responses are supported")
    return ChatParams(messages=messages, logprobs=_chat_logprobs(body), **_common(body, max_tokens, field_name))


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat's `logprobs` (true: the drawn tokens') and `top_logprobs` (how many likeliest), as one count."""
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", limits.LOGPROBS)
    if top is not None and not wanted:
        raise InvalidArgument("needs logprobs: true", field="top_logprobs")
    return (top or 0) if wanted else None
