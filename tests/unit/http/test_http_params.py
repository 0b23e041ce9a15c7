"""OpenAI request bodies: what is accepted, and every rejection names its field."""

from __future__ import annotations

from typing import Any

import pytest

from shared.errors import InvalidArgument
from shared.http.params import ChatMessage, parse_chat, parse_completion


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi"} | fields


def rejected_field(parse: Any, body: object) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse(body)
    assert info.value.fields, info.value
    return info.value.fields[0]


def test_completion_defaults() -> None:
    p = parse_completion({"prompt": "hello"})
    assert p.prompt == "hello" and p.model is None
    assert p.max_tokens == 16 and not p.stream and p.stop == () and not p.include_usage
    assert p.sampling.temperature == 0.0 and p.sampling.greedy  # greedy unless asked (OpenAI's default is 1)
    assert p.sampling.top_p == 1.0 and p.sampling.top_k == 0 and p.sampling.seed is None
    assert p.stop_token_ids == () and not p.ignore_eos


def test_completion_accepts_what_clients_and_routers_send() -> None:
    p = parse_completion(
        completion(
            prompt=[[1, 2, 3]], max_tokens=5, temperature=0, top_p=0.5, seed=7, n=1, stop=["\n", "x"], stream=True,
            stream_options={"include_usage": True}, min_tokens=1, echo=False, best_of=1, logprobs=None, user="u",
            kv_transfer_params={"do_remote_decode": True}, skip_special_tokens=True, return_hidden_states=False,
        )
    )  # fmt: skip
    assert p.prompt == [1, 2, 3] and p.max_tokens == 5 and p.stop == ("\n", "x") and p.include_usage
    assert p.sampling.greedy and p.sampling.seed == 7 and p.min_tokens == 1
    assert p.kv_transfer_params == {"do_remote_decode": True}
    assert parse_completion(completion(prompt=["one"])).prompt == "one"
    assert parse_completion(completion(stop="END")).stop == ("END",)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"echo": "yes"}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"best_of": 17}, "best_of"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"kv_transfer_params": "x"}, "kv_transfer_params"),
        ({"model": 5}, "model"),
    ],
)
def test_completion_rejections_name_the_field(fields: dict[str, Any], field: str) -> None:
    assert rejected_field(parse_completion, completion(**fields)) == field


def test_missing_prompt_and_non_object_body() -> None:
    assert rejected_field(parse_completion, {"model": "m"}) == "prompt"
    assert rejected_field(parse_completion, [1, 2]) == "body"


def test_chat_messages_and_limits() -> None:
    p = parse_chat(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            "max_completion_tokens": 3,
        }
    )
    assert p.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "ab"), ChatMessage("assistant", ""))
    assert p.max_tokens == 3 and p.max_tokens_field == "max_completion_tokens"
    unlimited = parse_chat({"messages": [{"role": "user", "content": "x"}]})
    assert unlimited.max_tokens is None and unlimited.max_tokens_field == "max_tokens"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 1.5}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ],
)
def test_chat_rejections_name_the_field(body: dict[str, Any], field: str) -> None:
    assert rejected_field(parse_chat, body) == field


def test_logprobs_become_one_count() -> None:
    assert parse_completion(completion()).logprobs is None
    assert parse_completion(completion(logprobs=0)).logprobs == 0
    assert parse_completion(completion(logprobs=20)).logprobs == 20
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_chat(chat).logprobs is None
    assert parse_chat({**chat, "logprobs": False}).logprobs is None
    assert parse_chat({**chat, "logprobs": True}).logprobs == 0
    assert parse_chat({**chat, "logprobs": True, "top_logprobs": 5}).logprobs == 5
