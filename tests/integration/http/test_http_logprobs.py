"""Logprobs in vLLM's / OpenAI's response shapes through the official `openai` client, on a real
pair (tests/integration/http/conftest.py): the numbers are the colocated run's bit for bit,
streamed or not, completions (top-k per token, text offsets) and chat (logprobs + top_logprobs)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import openai
import pytest

from decode_svc import tokenizer
from shared.engine.logprobs import TokenLogprobs
from shared.engine.stopping import StopRule
from shared.runtime.colocated import Colocated
from tests.integration.http.conftest import MODEL, HttpPair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PROMPT = "Logprobs of a hybrid model"
CHAT_PROMPT = "<|user|>\nhi\n<|assistant|>\n"  # the byte template's rendering of one user message


async def colocated(prompt: str, max_tokens: int, k: int) -> list[TokenLogprobs]:
    run = await asyncio.to_thread(Colocated.build, "reference", MODEL, 1, 512)
    try:
        out = [t async for t in run.stream("c", list(prompt.encode()), max_tokens, stop=StopRule(max_tokens), logprobs=k)]
    finally:
        run.close()
    return [t.logprobs for t in out if t.logprobs is not None]


def text_of(pair: HttpPair, ids: Sequence[int]) -> str:
    return tokenizer.for_engine(pair.decode.host.engine).decode(list(ids))


def client(pair: HttpPair) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_completion_logprobs_are_the_colocated_numbers(http_pair: HttpPair) -> None:
    want = await colocated(PROMPT, 12, 3)
    async with client(http_pair) as c:
        out = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None and lp.text_offset is not None
    assert lp.token_logprobs == [w.logprob for w in want]  # bit for bit
    assert lp.tokens == [text_of(http_pair, [w.token_id]) for w in want]
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    for top, w in zip(lp.top_logprobs, want, strict=True):
        expected = {text_of(http_pair, [t]): v for t, v in w.top}
        expected.setdefault(text_of(http_pair, [w.token_id]), w.logprob)  # the drawn token is always there
        assert top == expected  # byte tokens that decode alike ("\ufffd") share a key, as in vLLM
    # Negative control: another prompt's numbers differ, so the equality above can fail.
    other = await colocated(PROMPT + "!", 12, 3)
    assert lp.token_logprobs != [w.logprob for w in other]
    await http_pair.blocks_freed()


async def test_streamed_completion_logprobs_equal_the_whole_response(http_pair: HttpPair) -> None:
    async with client(http_pair) as c:
        whole = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logprobs=2)
        stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logprobs=2, stream=True)
        chunks = [chunk async for chunk in stream]
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs is not None]
    assert len(parts) > 1
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for name, values in merged.items():
            values += getattr(part, name) or []
    expected = whole.choices[0].logprobs
    assert expected is not None
    assert merged == {name: getattr(expected, name) for name in merged}


async def test_chat_logprobs_and_top_logprobs(http_pair: HttpPair) -> None:
    want = await colocated(CHAT_PROMPT, 8, 2)
    messages: Any = [{"role": "user", "content": "hi"}]
    async with client(http_pair) as c:
        out = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, logprobs=True, top_logprobs=2)
        stream = await c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, logprobs=True, top_logprobs=2, stream=True
        )
        streamed = [entry async for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                    for entry in chunk.choices[0].logprobs.content or []]  # fmt: skip
        plain = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [e.logprob for e in content] == [w.logprob for w in want]
    for entry, w in zip(content, want, strict=True):
        assert entry.token == text_of(http_pair, [w.token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(text_of(http_pair, [t]), v) for t, v in w.top]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    assert plain.choices[0].logprobs is None  # not asked: none


async def test_bad_logprobs_are_400_naming_the_field(http_pair: HttpPair) -> None:
    async with client(http_pair) as c:
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=21)
        assert "logprobs" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, top_logprobs=2
            )
        assert "top_logprobs" in str(e.value)


async def colocated_prompt(prompt: str, k: int) -> list[TokenLogprobs]:
    run = await asyncio.to_thread(Colocated.build, "reference", MODEL, 1, 512)
    try:
        out = [t async for t in run.stream("c", list(prompt.encode()), 1, stop=StopRule(1), prompt_logprobs=k)]
    finally:
        run.close()
    assert out[0].prompt_logprobs is not None
    return list(out[0].prompt_logprobs)


async def test_echo_with_logprobs_is_a_loglikelihood_evaluation(http_pair: HttpPair) -> None:
    """What evaluation harnesses send to score a continuation: echo, logprobs 1, max_tokens 1,
    temperature 0; the prompt's numbers are prefill's, the colocated run's bit for bit."""
    want = await colocated_prompt(PROMPT, 1)
    async with client(http_pair) as c:
        out = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
        streamed = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1, echo=True, stream=True)
        chunks = [ch async for ch in streamed]
        plain = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    n = len(PROMPT)
    assert choice.text.startswith(PROMPT) and len(lp.tokens) == n + 1
    assert lp.tokens[:n] == list(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first prompt token
    assert lp.token_logprobs[1:n] == [w.logprob for w in want]
    assert sum(lp.token_logprobs[1:n]) == sum(w.logprob for w in want)  # the loglikelihood a harness adds up
    assert lp.text_offset == list(range(n + 1))  # one character per byte token here
    # Negative control: another prompt's numbers differ.
    other = await colocated_prompt(PROMPT.replace("hybrid", "hybris"), 1)
    assert lp.token_logprobs[1:n] != [w.logprob for w in other]
    # Streamed: the prompt first, in the first chunk, with its logprobs.
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs is not None and first.logprobs.token_logprobs == lp.token_logprobs[:n]
    # echo without logprobs: the text only.
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    await http_pair.blocks_freed()
