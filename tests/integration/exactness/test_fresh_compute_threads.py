"""The first requests a new pair of services computes are exact, in the order that exposed
fresh compute threads: a 1-token prompt (prefill computes nothing, decode's check recomputes
nothing), then a 2-token prompt (the first model math on prefill's compute thread and on the
recompute of decode's check)."""

from __future__ import annotations

import pytest

from shared.engine.reference.colocated import colocated_generate
from shared.layout.presets import TINY_PRESETS
from tests.integration.exactness.pair import service_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]
TP_PAIRS = [(1, 1), (2, 2)]


@pytest.mark.parametrize("prefill_tp,decode_tp", TP_PAIRS, ids=[f"P{p}-D{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("model", sorted(TINY_PRESETS))
async def test_one_token_then_two_tokens_on_fresh_services(model: str, prefill_tp: int, decode_tp: int) -> None:
    async with service_pair(model, prefill_tp, decode_tp, extra_decode=["--check-state"]) as pair:
        for prompt in ([72], [72, 105]):
            got = await pair.generate(prompt, 4)
            assert got.summary.state_verified
            assert got.token_ids == colocated_generate(TINY_PRESETS[model], prompt, 4), f"prompt {prompt}"
