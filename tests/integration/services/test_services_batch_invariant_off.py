"""--batch-invariant off on both services of a paged pair: the pair serves, both engines run
their batches as one GEMM (the setting reached them), start-up says so, and a request alone
equals a colocated request alone on an engine built the same way. (With it on, the default, the
invariance tests cover it: tests/integration/exactness/test_paged_under_load.py and
tests/unit/engine_batched.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from shared.runtime.colocated import Colocated
from tests.integration.services.hf_services import generate_with, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]

PROMPT = [5, 17, 33, 2, 91, 40, 7, 12, 60, 3, 21]


async def colocated_tokens(model: str, max_tokens: int, *, invariant: bool) -> list[int]:
    built = await asyncio.to_thread(Colocated.build, "paged", model, 1, 256, batch_invariant=invariant)
    try:
        return await built.generate("c", PROMPT, max_tokens)
    finally:
        built.close()


async def test_a_pair_with_batch_invariance_off_serves_and_its_engines_know(
    hf_checkpoint: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    model = hf_checkpoint("qwen3_5")
    off = ("--batch-invariant", "off")
    with caplog.at_level(logging.INFO, logger="shared.runtime.engine_host"):
        async with hf_pair(model, model, 1, 1, engine="paged", prefill_flags=off, decode_flags=off) as (prefill, decode):
            assert prefill.settings.batch_invariant is False and decode.settings.batch_invariant is False
            engines = [prefill.host.engine, decode.host.engine]
            assert [getattr(e, "batch_invariant", None) for e in engines] == [False, False]
            ids, summary = await generate_with(decode.port, prompt_token_ids=PROMPT, max_tokens=8, ignore_eos=True)
    assert len(ids) == summary.generated_token_count == 8
    assert ids == await colocated_tokens(model, 8, invariant=False)
    said = [r.getMessage() for r in caplog.records if "batch invariance off" in r.getMessage()]
    assert len(said) == 2 and all(line.startswith("engine paged: checkpoint") for line in said)  # both services
