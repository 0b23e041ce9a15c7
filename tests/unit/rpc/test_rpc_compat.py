"""Handshake compatibility rules on layout messages built from the real layout math."""

from __future__ import annotations

import pytest

from shared.errors import IncompatibleLayout, InvalidArgument
from shared.layout.page import build_engine_layout
from shared.layout.presets import get_preset
from shared.pb.hybridpd.v1 import layout_pb2 as pb
from shared.rpc.compat import check_pair, malformed_issues, pairing_issues
from shared.runtime.layout_message import RankMemory, engine_layout_message


def message(
    role: str, tp: int, *, model: str = "tiny-mamba2", kv: str | None = None, block_size: int | None = None
) -> pb.EngineLayout:
    spec = get_preset(model).with_dtypes(kv=kv)  # type: ignore[arg-type]
    layout = build_engine_layout(spec, tp, block_size=block_size, kernel_block_size=16)
    ranks = [RankMemory(f"{role}-r{r}", b"meta", "cpu", 0, tuple(range(1000, 1000 + layout.num_regions))) for r in range(tp)]
    return engine_layout_message(layout, role=role, engine_id=role, incarnation=11, num_logical_blocks=32, ranks=ranks)


def check(prefill: pb.EngineLayout, decode: pb.EngineLayout, local_role: str = "prefill", model: str = "tiny-mamba2") -> object:
    ours = prefill if local_role == "prefill" else decode
    spec = get_preset(model)
    layout = build_engine_layout(spec, ours.tp_size, block_size=ours.block_size, kernel_block_size=ours.kernel_block_size)
    return check_pair(prefill, decode, local_role=local_role, local_layout=layout, spec=spec)


def test_compatible_pairs_give_a_plan() -> None:
    for p_tp, d_tp in [(1, 1), (1, 2), (2, 1), (4, 2)]:
        plan = check(message("prefill", p_tp), message("decode", d_tp))
        assert len(plan.ranks) == d_tp  # type: ignore[attr-defined]
    # Different logical block sizes on the two sides are fine.
    check(message("prefill", 1), message("decode", 1, block_size=256))


def test_every_differing_field_is_listed() -> None:
    prefill, decode = message("prefill", 2), message("decode", 2)
    decode.model.kv_dtype = pb.DATA_TYPE_FP8
    decode.model.conv_dtype = pb.DATA_TYPE_BF16
    decode.model.vocab_size = 7
    decode.conv_layout = pb.CONV_LAYOUT_SD
    decode.protocol_version = 99
    fields = [i.field for i in pairing_issues(prefill, decode)]
    for field in ("model.kv_dtype", "model.conv_dtype", "model.vocab_size", "conv_layout", "protocol_version"):
        assert field in fields
    with pytest.raises(IncompatibleLayout) as err:
        check(prefill, decode)
    assert "model.kv_dtype: prefill fp32, decode fp8" in err.value.message
    assert set(fields) == set(err.value.fields)


def test_a_boundary_mismatch_is_refused_naming_the_field() -> None:
    prefill, decode = message("prefill", 1), message("decode", 1)
    assert decode.boundary == pb.BOUNDARY_N_MINUS_1
    check(prefill, decode)  # control: the same boundary pairs
    prefill.boundary = pb.BOUNDARY_FULL
    with pytest.raises(IncompatibleLayout) as err:
        check(prefill, decode)
    assert err.value.status == "FAILED_PRECONDITION" and err.value.fields == ("boundary",)
    assert "boundary: prefill full, decode n-1" in err.value.message
    decode.boundary = pb.BOUNDARY_UNSPECIFIED  # a peer that does not say
    with pytest.raises(InvalidArgument) as bad:
        check(prefill, decode)
    assert "layout.boundary" in bad.value.fields


def test_real_model_difference_names_model_fields() -> None:
    issues = pairing_issues(message("prefill", 1), message("decode", 1, model="tiny-gdn"))
    assert {"model.name", "model.fingerprint", "model.family"} <= {i.field for i in issues}
    issues = pairing_issues(message("prefill", 1), message("decode", 1, kv="bf16"))
    assert {i.field for i in issues} == {"model.fingerprint", "model.kv_dtype"}


def test_tp_sizes_must_divide() -> None:
    prefill, decode = message("prefill", 2), message("decode", 2)
    decode.tp_size = 3
    assert "tp_size" in [i.field for i in pairing_issues(prefill, decode)]


def test_advertised_geometry_must_match_our_math() -> None:
    prefill, decode = message("prefill", 1), message("decode", 2)
    prefill.ranks[0].page_bytes += 16
    prefill.ranks[0].conv_sections[1].size_bytes -= 2
    with pytest.raises(IncompatibleLayout) as err:
        check(prefill, decode, local_role="decode")
    assert set(err.value.fields) == {"ranks[0].page_bytes", "ranks[0].conv_sections"}


def test_malformed_messages() -> None:
    msg = message("decode", 2)
    msg.ranks[1].tp_rank = 0
    msg.ranks[0].agent_name = ""
    msg.num_physical_blocks += 1
    fields = {i.field for i in malformed_issues(msg, pb.ENGINE_ROLE_DECODE)}
    assert fields == {"ranks[1].tp_rank", "ranks[0].agent_name", "num_physical_blocks"}
    assert {i.field for i in malformed_issues(message("prefill", 1), pb.ENGINE_ROLE_DECODE)} == {"role"}
    with pytest.raises(InvalidArgument) as err:
        check(message("prefill", 1), msg)
    assert "layout.ranks[0].agent_name" in err.value.fields


def test_only_a_prefill_layout_may_announce_prefill_chunks() -> None:
    prefill, decode = message("prefill", 1), message("decode", 1)
    prefill.prefill_chunk_tokens = 64
    check(prefill, decode)  # control: a prefill engine announces its chunks
    check(prefill, decode, local_role="decode")
    decode.prefill_chunk_tokens = 64
    with pytest.raises(InvalidArgument) as err:
        check(prefill, decode)
    assert err.value.fields == ("layout.prefill_chunk_tokens",)
    assert "got 64" in err.value.message
