"""A paged pair warms its engines up at start (the engine host runs `PagedEngine.warm_up` on
each service's compute thread before it serves): both services say so, every scratch block is
free again once they serve, and the first request's prefill and steps check no GEMM call sizes
(call_sizes.py) of their own; its tokens equal a colocated engine's. A cache too small for the
warm-up's scratch blocks starts without it, and says so."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.engine.paged import call_sizes
from shared.runtime.colocated import Colocated
from shared.runtime.engine_host import engine_factory_for
from tests.call_checks import count_checks
from tests.integration.services.hf_services import generate_with, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]

PROMPT = [5, 17, 33, 2, 91, 40, 7, 12, 60, 3, 21]


async def test_a_paged_pair_checks_its_gemms_at_start_not_at_the_first_request(
    hf_checkpoint: Callable[[str], str], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = hf_checkpoint("nemotron_h")
    checked = count_checks(monkeypatch)
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
        call_sizes.forget()


async def test_a_cache_too_small_for_the_warm_up_starts_without_it(
    hf_checkpoint: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    """One block cannot hold a request of a model with attention and SSM groups: the service
    says it skips the warm-up and starts (its requests then fail RESOURCE_EXHAUSTED, as before)."""
    args = ["--engine", "paged", "--model", hf_checkpoint("nemotron_h"), "--num-blocks", "1", "--port", "0"]
    settings = parse_settings("prefill", [*args, "--host", "127.0.0.1", "--loop", "asyncio"], environ={})
    with caplog.at_level(logging.INFO, logger="shared.runtime.engine_host"):
        app = await PrefillApp.start(settings, engine_factory_for("paged", settings))
        try:
            used = app.host.allocator.num_used
        finally:
            await asyncio.wait_for(app.stop(), 30)
    said = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("engine warm-up skipped: the cache has no room") for line in said), said
    assert not any(line.startswith("engine warmed up") for line in said)
    assert used == 0
