"""The decode leg's two pure steps: GenerateRequest.kv_transfer_params (JSON) becomes the
RequestContext's `remote` once, and the domain Manifest a claim answers (after its trip through
the message) is checked against the params prefill answered from that same manifest. Each
mismatch is refused naming its field; the matching manifest passes (the negative control)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from decode_svc.learned_peers import check_claimed, remote_prefill_of
from shared.cache.manifest import Manifest
from shared.errors import ServiceError
from shared.http.kv_transfer import RemotePrefill, parse_remote_prefill, prefill_answer
from shared.rpc.manifest_message import ManifestSource, manifest_from_message, manifest_message

SOURCE = ManifestSource("p0", num_groups=2, num_logical_blocks=16, digests_required=False)


def claimed() -> Manifest:
    return Manifest(
        request_id="leg-1",
        transfer_id="t-7",
        block_ids=(np.array([3, 4, 9], dtype=np.int64), np.array([15], dtype=np.int64)),
        num_computed_tokens=40,
        prompt_token_count=41,
        lease_ns=2_000_000_000,
        lease_expire_time_ns=1_760_000_000_000_000_000,
        prefill_ns=1_000,
    )


def answer(m: Manifest) -> dict[str, object]:
    """What prefill's HTTP leg answers for `m` (as prefill_svc/http_api.py builds it)."""
    return prefill_answer(
        engine_id="p0",
        request_id=m.request_id,
        host="10.0.0.7",
        port=50051,
        block_ids=[ids.tolist() for ids in m.block_ids],
        tp_size=1,
        num_tokens=m.prompt_token_count,
        num_computed_tokens=m.num_computed_tokens,
        expiry_time=m.lease_expire_time_ns / 1e9,
        incarnation=0xBEEF,
        transfer_id=m.transfer_id,
    )


def remote() -> RemotePrefill:
    parsed = remote_prefill_of(json.dumps(answer(claimed())))
    assert parsed is not None
    return parsed


def test_kv_transfer_params_json_parses_as_the_params_themselves() -> None:
    params = answer(claimed())
    assert remote_prefill_of(json.dumps(params)) == parse_remote_prefill(params)
    assert remote().transfer_id == "t-7" and remote().block_ids == ((3, 4, 9), (15,))


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("{not json", "kv_transfer_params"),
        ("[1, 2]", "kv_transfer_params"),
        (
            json.dumps({k: v for k, v in answer(claimed()).items() if k != "hybrid_pd"}),
            "kv_transfer_params.hybrid_pd.transfer_id",
        ),
    ],
)
def test_bad_kv_transfer_params_name_their_field(text: str, field: str) -> None:
    with pytest.raises(ServiceError) as info:
        remote_prefill_of(text)
    assert info.value.status == "INVALID_ARGUMENT"
    assert info.value.issues[0].field == field


def test_no_params_or_not_a_decode_leg_is_no_remote_prefill() -> None:
    assert remote_prefill_of("") is None
    assert remote_prefill_of(json.dumps({"do_remote_decode": True})) is None


def test_the_claimed_manifest_after_its_trip_matches_the_params() -> None:
    arrived = manifest_from_message(manifest_message(claimed()), SOURCE)
    check_claimed(remote(), arrived, prompt_tokens=41, computed=40, prompt_field="prompt")  # negative control: passes


@pytest.mark.parametrize(
    ("change", "prompt_tokens", "computed", "field", "reason"),
    [
        (
            {"block_ids": (np.array([3, 4, 8], dtype=np.int64), np.array([15], dtype=np.int64))},
            41,
            40,
            "kv_transfer_params.remote_block_ids",
            "BLOCKS_MISMATCH",
        ),
        ({}, 42, 40, "prompt", "INVALID_ARGUMENT"),
        ({}, 41, 41, "kv_transfer_params.hybrid_pd.num_computed_tokens", "BOUNDARY_MISMATCH"),
    ],
)
def test_a_claimed_manifest_unlike_the_params_is_refused_naming_the_field(
    change: dict[str, Any], prompt_tokens: int, computed: int, field: str, reason: str
) -> None:
    arrived = manifest_from_message(manifest_message(dataclasses.replace(claimed(), **change)), SOURCE)
    with pytest.raises(ServiceError) as info:
        check_claimed(remote(), arrived, prompt_tokens=prompt_tokens, computed=computed, prompt_field="prompt")
    assert info.value.issues[0].field == field
    assert info.value.reason == reason
