"""Each request field's range (shared/limits.py, from the proto field types), refused naming the
exact field on every surface: HTTP (400, the error object's `param`), gRPC (INVALID_ARGUMENT with
a BadRequest field violation) and `hybrid-pd generate` (one line naming the flag, exit 2); and
the sampler's draws at values that used to raise."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from hybridpd_tools.cli.main import main
from shared import limits
from shared.engine.sampling import SamplingError, SamplingParams, sample
from shared.errors import InvalidArgument
from shared.http.errors import http_error
from shared.http.params import parse_chat, parse_completion
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc.status import from_rpc_status, to_rpc_status

U32, U64 = 2**32 - 1, 2**64 - 1


def test_ranges_follow_the_proto_field_types() -> None:
    assert (limits.TOKEN_ID.low, limits.TOKEN_ID.high) == (0, U32)
    assert (limits.MAX_TOKENS.low, limits.MAX_TOKENS.high) == (1, U32)
    assert (limits.MIN_TOKENS.low, limits.MIN_TOKENS.high) == (0, U32)
    assert (limits.TOP_K.low, limits.TOP_K.high) == (0, U32)
    assert (limits.SEED.low, limits.SEED.high) == (0, U64)
    for name, value in (("max_tokens", U32), ("min_tokens", U32), ("prompt_token_ids", [U32]), ("stop_token_ids", [U32])):
        pb.GenerateRequest(**{name: value})  # the wire holds the highest value
        with pytest.raises(ValueError):
            pb.GenerateRequest(**{name: value + 1 if isinstance(value, int) else [U32 + 1]})
    pb.SamplingParams(seed=U64, top_k=U32)


def test_the_wire_seed_is_the_samplers() -> None:
    assert SamplingParams(temperature=1.0, seed=limits.SEED.high).seed == U64
    with pytest.raises(SamplingError):
        SamplingParams(temperature=1.0, seed=limits.SEED.high + 1)
    assert limits.seed_bits(-1) == U64 and limits.seed_bits(5) == 5
    assert limits.HTTP_SEED.low == -(2**63) and limits.HTTP_SEED.high == U64


def _http_param(parse: Any, body: dict[str, Any]) -> str | None:
    with pytest.raises(InvalidArgument) as err:
        parse(json.loads(json.dumps(body)))  # what the server reads: NaN, Infinity and escapes included
    reply = http_error(err.value)
    assert reply.status == 400
    param: str | None = reply.body["error"]["param"]
    return param


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": 2**33}, "max_tokens"),
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"max_tokens": U32 + 1}, "max_tokens"),
        ({"min_tokens": U32 + 1}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"top_k": 2**40}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"stop_token_ids": [1, 2**40]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": [1, 2**70]}, "prompt"),
        ({"prompt": [[U32 + 1]]}, "prompt"),
        ({"prompt": "\ud800"}, "prompt"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": float("-inf")}, "top_p"),
        ({"presence_penalty": 10**400}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ],
)
def test_http_completion_fields_out_of_range(extra: dict[str, Any], field: str) -> None:
    assert _http_param(parse_completion, {"prompt": "hi", **extra}) == field


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": 2**33}, "max_tokens"),
        ({"max_completion_tokens": 10**12}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages[0].content[0].text"),
    ],
)
def test_http_chat_fields_out_of_range(extra: dict[str, Any], field: str) -> None:
    assert _http_param(parse_chat, {"messages": [{"role": "user", "content": "hi"}], **extra}) == field


def test_http_values_at_the_edges_are_accepted() -> None:
    params = parse_completion({"prompt": [0, U32], "max_tokens": U32, "top_k": U32, "seed": U64, "stop_token_ids": [U32]})
    assert params.max_tokens == U32 and params.sampling.top_k == U32 and params.sampling.seed == U64
    assert parse_completion({"prompt": "x", "seed": -(2**63), "temperature": 1e-310, "top_p": 5e-324}).sampling.seed == -(2**63)


def _grpc_fields(request: pb.GenerateRequest) -> tuple[str, ...]:
    with pytest.raises(InvalidArgument) as err:
        limits.check_request(request)
    failure = from_rpc_status(to_rpc_status(err.value))  # what a client reads from the status
    assert failure.status == "INVALID_ARGUMENT"
    return failure.fields


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.GenerateRequest(max_tokens=0), "max_tokens"),
        (pb.GenerateRequest(max_tokens=1, sampling=pb.SamplingParams(temperature=math.nan)), "sampling.temperature"),
        (pb.GenerateRequest(max_tokens=1, sampling=pb.SamplingParams(temperature=-math.inf)), "sampling.temperature"),
        (pb.GenerateRequest(max_tokens=1, sampling=pb.SamplingParams(temperature=1e39)), "sampling.temperature"),
        (pb.GenerateRequest(max_tokens=1, sampling=pb.SamplingParams(temperature=-0.5)), "sampling.temperature"),
        (pb.GenerateRequest(max_tokens=1, sampling=pb.SamplingParams(top_p=math.nan)), "sampling.top_p"),
        (pb.GenerateRequest(max_tokens=1, sampling=pb.SamplingParams(top_p=0.0)), "sampling.top_p"),
        (pb.GenerateRequest(max_tokens=1, sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
    ],
)
def test_grpc_fields_out_of_range(request_: pb.GenerateRequest, field: str) -> None:
    assert _grpc_fields(request_) == (field,)


def test_grpc_values_at_the_edges_are_accepted() -> None:
    sampling = pb.SamplingParams(temperature=limits.FLOAT32_MAX, top_p=5e-324, top_k=U32, seed=U64)
    limits.check_request(pb.GenerateRequest(max_tokens=U32, min_tokens=U32, sampling=sampling))


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-tokens", str(2**33)),
        ("--max-tokens", str(10**12)),
        ("--min-tokens", str(U32 + 1)),
        ("--top-k", str(2**40)),
        ("--seed", str(2**70)),
        ("--seed", "-1"),
        ("--temperature", "nan"),
        ("--temperature", "1e400"),
        ("--top-p", "0"),
        ("--top-p", "inf"),
        ("--timeout", "nan"),
        ("--prompt-ids", f"1,{2**70}"),
    ],
)
def test_generate_flags_out_of_range(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    prompt = [] if flag == "--prompt-ids" else ["--prompt", "hi"]
    with pytest.raises(SystemExit) as done:
        main(["generate", "--decode", "127.0.0.1:1", *prompt, f"{flag}={value}"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"hybrid-pd generate: error: argument {flag}: "), err
    assert "Value out of range" not in err and "Traceback" not in err


def test_the_sampler_draws_at_extreme_but_valid_values() -> None:
    logits = torch.tensor([0.0, 3.0, -2.0, 7.0, 7.0 - 1e-3])
    for temperature in (1e-30, 1e-38, 1e-45, 1e-310, 5e-324):  # the scores overflow fp32: the greedy token
        assert sample(logits, SamplingParams(temperature=temperature, seed=1), 0) == 3
    for top_p in (1e-45, 5e-324):  # 0 in fp32: the likeliest token stays
        assert sample(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=1), 0) == 3
