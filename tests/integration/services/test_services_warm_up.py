"""A paged pair warms its engines up at start (the engine host runs `PagedEngine.warm_up` on
each service's compute thread before it serves): both services say so, every scratch block is
free again once they serve, and the first request's prefill and steps check no GEMM call sizes
(call_sizes.py) of their own; its tokens equal a colocated engine's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
from torch import Tensor

from shared.engine.paged import call_sizes
from shared.runtime.colocated import Colocated
from tests.integration.services.hf_services import generate_with, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]

PROMPT = [5, 17, 33, 2, 91, 40, 7, 12, 60, 3, 21]


async def test_a_paged_pair_checks_its_gemms_at_start_not_at_the_first_request(
    hf_checkpoint: Callable[[str], str], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = hf_checkpoint("nemotron_h")
    call_sizes.forget()  # what earlier tests in this process checked would hide the warm-up's checks
    checked: list[int] = []
    agreements = call_sizes.agreements

    def counted(weight: Tensor, *rest: Any, **named: Any) -> list[bool]:
        checked.append(weight.shape[0])
        return agreements(weight, *rest, **named)

    monkeypatch.setattr(call_sizes, "agreements", counted)
    with caplog.at_level(logging.INFO, logger="shared.runtime.engine_host"):
        async with hf_pair(model, model, 1, 1, engine="paged") as (prefill, decode):
            at_start = len(checked)
            free_at_start = (prefill.host.allocator.num_used, decode.host.allocator.num_used)
            ids, _ = await generate_with(decode.port, prompt_token_ids=PROMPT, max_tokens=6, ignore_eos=True)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine warmed up")]
    assert len(said) == 2, said  # prefill and decode
    assert at_start > 0 and checked[at_start:] == [], checked
    assert free_at_start == (0, 0)
    built = await asyncio.to_thread(Colocated.build, "paged", model, 1, 256)
    try:
        assert ids == await built.generate("c", PROMPT, 6)
    finally:
        built.close()
