"""Sampling and stop token ids through the HTTP API (the official `openai` client): a seeded
completion is the gRPC Generate's tokens with the same sampling, another seed other text; vLLM's
stop_token_ids end it with finish_reason "stop", and min_tokens keeps them and stop sequences from
ending it early; penalties no engine applies are refused."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import openai
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from tests.integration.http.conftest import MODEL, HttpPair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PROMPT = "Sampled state"


def _complete(pair: HttpPair, **kwargs: Any) -> Any:
    with openai.OpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        return client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)


async def _grpc_ids(pair: HttpPair, **fields: Any) -> list[int]:
    ids: list[int] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pair.decode.port}") as channel:
        request = dpb.GenerateRequest(prompt=PROMPT, **fields)
        async for reply in dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=30):
            if reply.HasField("chunk"):
                ids.extend(reply.chunk.token_ids)
    return ids


async def test_seeded_completion_is_the_grpc_sampling(http_pair: HttpPair) -> None:
    args = dict(max_tokens=20, temperature=1.3, top_p=0.95, extra_body={"top_k": 50})
    seven = await asyncio.to_thread(_complete, http_pair, seed=7, **args)
    eight = await asyncio.to_thread(_complete, http_pair, seed=8, **args)
    sampling = dpb.SamplingParams(temperature=1.3, top_p=0.95, top_k=50, seed=7)
    ids = await _grpc_ids(http_pair, max_tokens=20, sampling=sampling)
    assert seven.choices[0].text == bytes(ids).decode("utf-8", errors="replace")
    assert seven.choices[0].text != eight.choices[0].text  # negative control: the seed reaches the engine
    await http_pair.blocks_freed()


async def test_stop_token_ids_finish_with_stop(http_pair: HttpPair) -> None:
    ids = await _grpc_ids(http_pair, max_tokens=12)
    cut = next(i for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    out = await asyncio.to_thread(_complete, http_pair, max_tokens=12, extra_body={"stop_token_ids": [ids[cut]]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == cut + 1
    full = await asyncio.to_thread(_complete, http_pair, max_tokens=12)
    assert full.choices[0].finish_reason == "length"  # control


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
async def test_penalties_are_refused_naming_the_field(http_pair: HttpPair, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await asyncio.to_thread(_complete, http_pair, max_tokens=2, **{field: 0.5})
    assert err.value.body["param"] == field  # type: ignore[index]
    await http_pair.blocks_freed()


async def test_min_tokens_keeps_a_stop_token_id_from_ending_early(http_pair: HttpPair) -> None:
    ids = await _grpc_ids(http_pair, max_tokens=12)
    stop = {"stop_token_ids": [ids[0]]}  # the first greedy pick
    cut = await asyncio.to_thread(_complete, http_pair, max_tokens=12, extra_body=stop)
    assert (cut.choices[0].finish_reason, cut.usage.completion_tokens) == ("stop", 1)  # negative control
    out = await asyncio.to_thread(_complete, http_pair, max_tokens=12, extra_body=stop | {"min_tokens": 5})
    want = await _grpc_ids(http_pair, max_tokens=12, stop_token_ids=[ids[0]], min_tokens=5)
    assert len(want) >= 5 and ids[0] not in want[:5]
    assert out.choices[0].text == bytes(want).decode("utf-8", errors="replace")
    assert out.usage.completion_tokens == len(want)

    def chat() -> Any:
        with openai.OpenAI(base_url=http_pair.base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
            messages = [{"role": "user", "content": PROMPT}]
            return client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, extra_body={"stop_token_ids": [ids[0]], "min_tokens": 6}
            )

    reply = await asyncio.to_thread(chat)
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 6)
    await http_pair.blocks_freed()


@pytest.mark.parametrize(
    ("extra", "says"),
    [({"stop_token_ids": [256]}, "the vocabulary"), ({"stop_token_ids": list(range(256)), "min_tokens": 1}, "whole vocabulary")],
)
async def test_bad_stop_token_ids_are_a_400_naming_the_field(http_pair: HttpPair, extra: dict[str, Any], says: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await asyncio.to_thread(_complete, http_pair, max_tokens=2, extra_body=extra)
    body: Any = err.value.body
    assert body["param"] == "stop_token_ids" and says in body["message"], body
    await http_pair.blocks_freed()


async def test_min_tokens_keeps_a_stop_sequence_from_ending_early(http_pair: HttpPair) -> None:
    ids = await _grpc_ids(http_pair, max_tokens=24)
    # An ASCII byte (one character) that comes back: its first occurrence is before min_tokens, a later one after.
    k = next(i for i, t in enumerate(ids) if t < 128 and t in ids[i + 2 :])
    stop, min_tokens = chr(ids[k]), k + 2
    cut = await asyncio.to_thread(_complete, http_pair, max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == k + 1  # negative control
    out = await asyncio.to_thread(_complete, http_pair, max_tokens=24, stop=[stop], extra_body={"min_tokens": min_tokens})
    end = next(j for j in range(min_tokens - 1, len(ids)) if ids[j] == ids[k])
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == end + 1
    assert out.choices[0].text == bytes(ids[:end]).decode("utf-8", errors="replace")
    await http_pair.blocks_freed()


@pytest.mark.parametrize(("extra", "max_tokens"), [({"min_tokens": -1}, 4), ({"min_tokens": 5}, 4)])
async def test_bad_min_tokens_is_refused_naming_the_field(http_pair: HttpPair, extra: dict[str, int], max_tokens: int) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await asyncio.to_thread(_complete, http_pair, max_tokens=max_tokens, extra_body=extra)
    assert err.value.body["param"] == "min_tokens"  # type: ignore[index]
