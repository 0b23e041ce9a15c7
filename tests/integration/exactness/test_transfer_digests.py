"""Transfer digests, on by default: prefill digests every rank's FA / conv / SSM state per layer
group right after writing it; decode checks what it READ before its first model step.

The exactness matrix runs with digests on at every TP pair, so equal digests across TP sizes are
proven there; here: a byte flipped on prefill after its digests were taken (the TEST-ONLY
HYBRID_PD_TEST_CORRUPT hook) fails the request with DATA_LOSS naming the section, and the
switch that turns digests off, on both sides or on one.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from shared.cache.digest import SectionDigest, compare_digests
from shared.engine.reference.colocated import colocated_generate
from shared.layout.page import build_engine_layout
from shared.layout.presets import TINY_PRESETS
from shared.runtime.faults import FaultPlan, Injector
from tests.integration.exactness.pair import service_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROMPT = list(b"digests of every section")
SECTION_PAIRS = [("fa", 1, 1), ("conv", 1, 1), ("ssm", 1, 1), ("fa", 2, 4), ("conv", 4, 2), ("ssm", 2, 1)]


@pytest.mark.asyncio
@pytest.mark.parametrize("section,prefill_tp,decode_tp", SECTION_PAIRS, ids=[f"{s}-P{p}-D{d}" for s, p, d in SECTION_PAIRS])
async def test_a_flipped_byte_fails_the_request_naming_its_section(
    inject_faults: Callable[[Injector], None], section: str, prefill_tp: int, decode_tp: int
) -> None:
    inject_faults(FaultPlan(corrupt=f"{section}:victim-"))
    async with service_pair("tiny-mamba2", prefill_tp, decode_tp) as pair:
        healthy = await pair.generate(PROMPT, 4)  # other requests are untouched
        assert healthy.token_ids == colocated_generate(TINY_PRESETS["tiny-mamba2"], PROMPT, 4)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await pair.generate(PROMPT, 4, request_id="victim-1")
        telemetry = pair.decode.metrics.telemetry.exposition()
    assert failed.value.code() == grpc.StatusCode.DATA_LOSS
    details = failed.value.details() or ""
    assert (
        "victim-1" in details and f"prefill rank 0, {section} of layer group" in details and "read by decode ranks [0" in details
    )
    assert f'hybrid_pd_digest_mismatches_total{{section="{section}"}} 1.0' in telemetry
    others = {"fa", "conv", "ssm"} - {section}
    assert all(f'hybrid_pd_digest_mismatches_total{{section="{s}"}} 0.0' in telemetry for s in others)


@pytest.mark.asyncio
async def test_digests_off_on_both_sides() -> None:
    off = ["--verify-transfer", "off"]
    async with service_pair("tiny-gdn", 2, 1, extra_prefill=off, extra_decode=off) as pair:
        got = await pair.generate(PROMPT, 4)
    assert got.token_ids == colocated_generate(TINY_PRESETS["tiny-gdn"], PROMPT, 4)


@pytest.mark.asyncio
async def test_decode_checking_digests_refuses_a_prefill_that_sends_none() -> None:
    async with service_pair("tiny-gdn", 1, 1, extra_prefill=["--verify-transfer", "off"]) as pair:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await pair.generate(PROMPT, 4)
        assert pair.decode.host.allocator.num_used == 0
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--verify-transfer" in (failed.value.details() or "")


def test_compare_names_differing_and_missing_digests() -> None:
    layout = build_engine_layout(TINY_PRESETS["tiny-mamba2"], 1)
    a = [SectionDigest(0, "fa", 0, b"x"), SectionDigest(0, "ssm", 1, b"y")]
    assert compare_digests(layout, a, a) == []
    bad = compare_digests(layout, a, [SectionDigest(0, "fa", 0, b"z")])
    assert [(m.rank, m.section, m.group) for m in bad] == [(0, "fa", 0), (0, "ssm", 1)]
    assert bad[1].layers == layout.groups[1].layers


def test_the_corruption_hook_refuses_an_unknown_section() -> None:
    with pytest.raises(ValueError, match="SECTION"):
        FaultPlan(corrupt="kv:r").corruption("r")
    assert FaultPlan(corrupt="fa:victim-").corruption("other") is None
    assert FaultPlan(corrupt="fa:victim-").corruption("victim-2") == "fa"
