"""Logprobs in the OpenAI / vLLM response shapes.

Completions (`logprobs: k`): `choices[].logprobs` = {tokens, token_logprobs, top_logprobs,
text_offset}, each token as its own decoded text, `top_logprobs` one object per token mapping
token text to logprob for the k likeliest tokens and the drawn one (so up to k + 1 entries, as
the legacy API documents), `text_offset` the character offset of each token in the text.

With `echo`, the prompt's tokens come first, from prefill's prompt logprobs: the first prompt
token's `token_logprobs` and `top_logprobs` entries are null (nothing precedes it).

Chat (`logprobs: true`, `top_logprobs: k`): `choices[].logprobs` = {content: [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}] (the k likeliest)}]}.

The numbers are the model's raw distribution (shared/engine/logprobs.py); -inf is reported as
-9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.engine.logprobs import TokenLogprobs
from shared.engine.text import Tokenizer

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class CompletionLogprobs:
    """The completions object, built token by token (streamed chunks carry their own tokens;
    `text_offset` runs on across them)."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0) -> None:
        self._tokenizer = tokenizer
        self._offset = offset  # of the next token in the response's text

    def prompt_part(self, first_token: int, rest: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """The echoed prompt's entries: the first token has no logprob (null), the rest theirs."""
        text = self._tokenizer.decode([first_token])
        out = {"text_offset": [self._offset], "token_logprobs": [None], "tokens": [text], "top_logprobs": [None]}
        self._offset += len(text)
        more = self.part(rest)
        return {name: out[name] + more[name] for name in out}

    def part(self, tokens: Sequence[TokenLogprobs]) -> dict[str, Any]:
        out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for lp in tokens:
            text = self._tokenizer.decode([lp.token_id])
            out["tokens"].append(text)
            out["token_logprobs"].append(_value(lp.logprob))
            out["text_offset"].append(self._offset)
            self._offset += len(text)
            top = {self._tokenizer.decode([t]): _value(v) for t, v in lp.top}
            top.setdefault(text, _value(lp.logprob))
            out["top_logprobs"].append(top)
        return out


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(tokenizer: Tokenizer, tokens: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """The chat object for `tokens`."""
    content = []
    for lp in tokens:
        entry = _entry(tokenizer, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}
