"""vLLM's kv_transfer_params: the prefill leg's flags, prefill's answer round-tripping into the
decode leg, and every malformed or stale field rejected by name (exact types: the float
pp_size trap fails loudly)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared.errors import InvalidArgument
from shared.http.kv_transfer import (
    PrefillGroups,
    RemotePrefill,
    check_blocks,
    parse_remote_prefill,
    prefill_answer,
    wants_remote_decode,
    wants_remote_prefill,
)

ROUTER_PREFILL_LEG = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


def answer(**changes: Any) -> dict[str, Any]:
    params = prefill_answer(
        engine_id="prefill-a", request_id="req-1", host="10.0.0.5", port=50051, block_ids=[[3, 4, 5], [9]], tp_size=2,
        num_tokens=40, num_computed_tokens=39, expiry_time=1_800_000_000.5, incarnation=0xABC,
    )  # fmt: skip
    return json.loads(json.dumps(params)) | changes  # as it comes back through a router


def rejected(params: dict[str, Any]) -> str:
    with pytest.raises(InvalidArgument) as info:
        parse_remote_prefill(params)
    return info.value.fields[0]


def test_router_flags() -> None:
    assert wants_remote_decode(ROUTER_PREFILL_LEG) and not wants_remote_prefill(ROUTER_PREFILL_LEG)
    assert not wants_remote_decode(None) and not wants_remote_prefill(None) and not wants_remote_decode({})
    assert wants_remote_prefill(answer()) and not wants_remote_decode(answer())
    with pytest.raises(InvalidArgument) as both:
        wants_remote_decode({"do_remote_decode": True, "do_remote_prefill": True})
    assert both.value.fields == ("kv_transfer_params.do_remote_prefill",)
    with pytest.raises(InvalidArgument) as text:
        wants_remote_decode({"do_remote_decode": "true"})
    assert text.value.fields == ("kv_transfer_params.do_remote_decode",)


def test_answer_round_trips_through_json() -> None:
    remote = parse_remote_prefill(answer())
    assert remote == RemotePrefill(
        engine_id="prefill-a", request_id="req-1", host="10.0.0.5", port=50051, block_ids=((3, 4, 5), (9,)), tp_size=2,
        num_tokens=40, expiry_time=1_800_000_000.5, num_computed_tokens=39, incarnation="0000000000000abc",
    )  # fmt: skip
    assert remote.grpc_target == "10.0.0.5:50051"
    assert parse_remote_prefill(answer(remote_host="::1")).grpc_target == "[::1]:50051"
    raw = answer()
    assert all(type(v) is int for v in (raw["remote_port"], raw["tp_size"], raw["remote_num_tokens"]))


def test_vllm_shaped_params_without_our_extras() -> None:
    params = answer()
    del params["hybrid_pd"], params["remote_num_tokens"], params["remote_blocks_expiry_time"]
    remote = parse_remote_prefill(params | {"dcp_size": 1, "pp_size": 1})
    assert remote.num_computed_tokens is None and remote.incarnation is None and remote.num_tokens is None


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"do_remote_prefill": False}, "kv_transfer_params.do_remote_prefill"),
        ({"remote_engine_id": None}, "kv_transfer_params.remote_engine_id"),
        ({"remote_engine_id": 5}, "kv_transfer_params.remote_engine_id"),
        ({"remote_request_id": ""}, "kv_transfer_params.remote_request_id"),
        ({"remote_host": None}, "kv_transfer_params.remote_host"),
        ({"remote_port": None}, "kv_transfer_params.remote_port"),
        ({"remote_port": 50051.0}, "kv_transfer_params.remote_port"),
        ({"remote_port": 70000}, "kv_transfer_params.remote_port"),
        ({"tp_size": True}, "kv_transfer_params.tp_size"),
        ({"tp_size": 0}, "kv_transfer_params.tp_size"),
        ({"pp_size": 1.0}, "kv_transfer_params.pp_size"),  # the float trap
        ({"pp_size": 2}, "kv_transfer_params.pp_size"),
        ({"dcp_size": 4}, "kv_transfer_params.dcp_size"),
        ({"remote_block_ids": None}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": []}, "kv_transfer_params.remote_block_ids"),
        ({"remote_block_ids": [1, 2]}, "kv_transfer_params.remote_block_ids[0]"),
        ({"remote_block_ids": [[1], [2, -1]]}, "kv_transfer_params.remote_block_ids[1][1]"),
        ({"remote_block_ids": [[1.0]]}, "kv_transfer_params.remote_block_ids[0][0]"),
        ({"remote_blocks_expiry_time": "soon"}, "kv_transfer_params.remote_blocks_expiry_time"),
        ({"remote_num_tokens": 0}, "kv_transfer_params.remote_num_tokens"),
        ({"hybrid_pd": []}, "kv_transfer_params.hybrid_pd"),
        ({"hybrid_pd": {"version": 2}}, "kv_transfer_params.hybrid_pd.version"),
        ({"hybrid_pd": {"num_computed_tokens": 40}}, "kv_transfer_params.hybrid_pd.num_computed_tokens"),
        ({"hybrid_pd": {"num_computed_tokens": -1}}, "kv_transfer_params.hybrid_pd.num_computed_tokens"),
        ({"hybrid_pd": {"incarnation": 12}}, "kv_transfer_params.hybrid_pd.incarnation"),
    ],
)
def test_bad_fields_are_named(changes: dict[str, Any], field: str) -> None:
    assert rejected(answer(**changes)) == field


def test_block_ids_checked_against_the_prefill_layout() -> None:
    remote = parse_remote_prefill(answer())
    check_blocks(remote, PrefillGroups(num_logical_blocks=10, group_names=("attention", "mamba")))
    cases = [
        (PrefillGroups(10, ("attention",)), "kv_transfer_params.remote_block_ids"),
        (PrefillGroups(9, ("attention", "mamba")), "kv_transfer_params.remote_block_ids[1][0]"),
        (PrefillGroups(5, ("attention", "mamba")), "kv_transfer_params.remote_block_ids[0][2]"),
    ]
    for groups, field in cases:
        with pytest.raises(InvalidArgument) as info:
            check_blocks(remote, groups)
        assert info.value.fields == (field,)
    twice = parse_remote_prefill(answer(remote_block_ids=[[1, 2, 1], [3]]))
    with pytest.raises(InvalidArgument) as dup:
        check_blocks(twice, PrefillGroups(10, ("a", "m")))
    assert dup.value.fields == ("kv_transfer_params.remote_block_ids[0][2]",)
