"""The official `openai` client (sync, async, streaming) against decode's HTTP API: the text is
the colocated run's, usage and finish_reason are right, errors arrive as the client's own
exception types with the status and the field."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.integration.http.conftest import MODEL, HttpPair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PROMPT = "The state of a hybrid model"


def sync_client(pair: HttpPair) -> openai.OpenAI:
    return openai.OpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def async_client(pair: HttpPair) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_sync_completion_is_the_colocated_text(http_pair: HttpPair) -> None:
    def call() -> Any:
        with sync_client(http_pair) as client:
            return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, seed=3)

    out = await asyncio.to_thread(call)
    choice = out.choices[0]
    assert choice.text == http_pair.expected_text(PROMPT, 24)
    assert choice.text != http_pair.expected_text(PROMPT + "!", 24)  # negative control: the check can fail
    assert choice.finish_reason == "length"
    assert out.object == "text_completion" and out.model == MODEL
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT), 24)
    await http_pair.blocks_freed()


async def test_sync_completion_from_token_ids(http_pair: HttpPair) -> None:
    ids = [7, 200, 13, 99, 5, 64, 64, 1]

    def call() -> Any:
        with sync_client(http_pair) as client:
            return client.completions.create(model=MODEL, prompt=ids, max_tokens=9)

    out = await asyncio.to_thread(call)
    assert out.choices[0].text == http_pair.expected_text(ids, 9)
    assert out.usage.prompt_tokens == len(ids)


async def test_sync_chat_uses_the_byte_template(http_pair: HttpPair) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]

    def call() -> Any:
        with sync_client(http_pair) as client:
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)  # type: ignore[arg-type]

    out = await asyncio.to_thread(call)
    rendered = "<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n"
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == http_pair.expected_text(rendered, 12)
    assert out.usage is not None and out.usage.prompt_tokens == len(rendered)


async def test_async_streaming_completion_equals_the_whole_text(http_pair: HttpPair) -> None:
    async with async_client(http_pair) as client:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) > 1  # the first token alone, then the rest
    assert "".join(c.choices[0].text for c in text_chunks) == http_pair.expected_text(PROMPT, 40)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(PROMPT), 40)
    assert len({c.id for c in chunks}) == 1


async def test_async_streaming_chat(http_pair: HttpPair) -> None:
    async with async_client(http_pair) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == http_pair.expected_text("<|user|>\nhi\n<|assistant|>\n", 20)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_stop_sequence_ends_the_text_and_frees_the_blocks(http_pair: HttpPair) -> None:
    full = http_pair.expected_text(PROMPT, 40)
    stop = full[9:11]
    expected = full[: full.find(stop)]
    async with async_client(http_pair) as client:
        out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=[stop])
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, stop=stop, stream=True)
        chunks = [c async for c in stream]
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    # Byte tokens: the generated tokens up to and including the one that completed the stop.
    assert out.usage is not None and out.usage.completion_tokens == len(http_pair.expected_bytes(PROMPT, 40, stop))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    await http_pair.blocks_freed()


async def test_errors_arrive_as_client_exceptions_naming_the_field(http_pair: HttpPair) -> None:
    async with async_client(http_pair) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10**6)
        assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad_temp:
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=9)
        assert bad_temp.value.body["param"] == "temperature"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad_n:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=17)
        assert bad_n.value.body["param"] == "n"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as bad_stream:  # a streamed request fails before its first byte
            await client.completions.create(model=MODEL, prompt=[999999], max_tokens=2, stream=True)
        assert bad_stream.value.body["param"] == "prompt"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
        assert missing.value.body["code"] == 404 and missing.value.body["type"] == "NotFoundError"  # type: ignore[index]
        models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await http_pair.blocks_freed()


async def test_concurrent_requests_through_both_clients(http_pair: HttpPair) -> None:
    prompts = [f"{PROMPT} #{i}" for i in range(8)]
    async with async_client(http_pair) as client:
        outs = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, max_tokens=6) for p in prompts))
    assert [o.choices[0].text for o in outs] == [http_pair.expected_text(p, 6) for p in prompts]
    assert len({o.id for o in outs}) == len(prompts)
    await http_pair.blocks_freed()
