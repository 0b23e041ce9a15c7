"""Disaggregated == colocated bit for bit under load, on the batched paged engine: many requests
of mixed prompt lengths, lengths and sampling run at once through a real pair (tiny checkpoints
loaded from disk, real NIXL READs, prefill TP 1 -> decode TP 2), and every request's tokens
equal the same request computed ALONE by the colocated runner (one engine, the decode service's
step loop). Decode steps were shared, and so were prefill steps (whole prompts, or chunks of
16 tokens), so each request was batched with others of varying number on both sides.

Below the services, the same load in the step loop keeps every step's logits: bit-identical to
each request's run alone with invariance on; with it off (one GEMM over the batch, the negative
control) some differ, so the equality is not something any batching would give."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from shared.engine.paged.engine import PagedEngine
from shared.engine.sampling import SamplingParams
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.runtime.colocated import Colocated
from tests.integration.services.hf_services import generate_with, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

REQUESTS = 24
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=77)


def load(vocab: int) -> list[tuple[list[int], int, SamplingParams | None]]:
    """(prompt, max_tokens, sampling) of each request: prompts 1..45 tokens, every third seeded."""
    out = []
    for i in range(REQUESTS):
        prompt = [(13 * i + 7 * j) % (vocab - 4) + 4 for j in range(1 + (i * 11) % 45)]
        out.append((prompt, 4 + (i * 5) % 13, SEEDED if i % 3 == 0 else None))
    return out


async def alone(directory: str, requests: Sequence[tuple[list[int], int, SamplingParams | None]], **kw: Any) -> list[list[int]]:
    """Each request on its own through the colocated runner (one engine, nothing beside it)."""
    colocated = await asyncio.to_thread(Colocated.build, "paged", directory, 2, 256, **kw)
    try:
        return [
            await colocated.generate(f"alone-{i}", p, n, sampling=s or SamplingParams()) for i, (p, n, s) in enumerate(requests)
        ]
    finally:
        colocated.close()


async def together(port: int, requests: Sequence[tuple[list[int], int, SamplingParams | None]]) -> list[list[int]]:
    def fields(p: list[int], n: int, s: SamplingParams | None) -> dict[str, object]:
        f: dict[str, object] = {"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True}
        if s is not None:
            f["sampling"] = dpb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
        return f

    got = await asyncio.gather(*(generate_with(port, **fields(p, n, s)) for p, n, s in requests))
    return [ids for ids, _ in got]


# Prefill computes the prompts in batched steps too: whole prompts under the default budget, or
# chunks of 16 tokens under a budget of 64 (decode takes one manifest, so every job is stepped).
CHUNKED = ("--prefill-chunk-tokens", "16", "--max-batched-tokens", "64")


@pytest.mark.parametrize(
    ("family", "chunk", "threads"),
    [("nemotron_h", 0, 1), ("qwen3_5", 0, 1), ("nemotron_h", 16, 1), ("nemotron_h", 0, 2), ("nemotron_h", 16, 3)],
)
async def test_requests_under_load_equal_each_alone(
    hf_checkpoint: Callable[[str], str], family: str, chunk: int, threads: int
) -> None:
    """Also with prefill steps split over `--prefill-threads`: the same bits as alone."""
    directory = hf_checkpoint(family)
    async with hf_pair(
        directory,
        directory,
        1,
        2,
        engine="paged",
        check_state=not chunk,  # decode recomputes each prompt alone (in one forward): the READ state must be its bits
        prefill_flags=(*(CHUNKED if chunk else ()), "--prefill-threads", str(threads)),
        decode_flags=("--num-blocks", "256", *(("--manifest-parts", "false") if chunk else ())),
    ) as (prefill, decode):
        requests = load(decode.host.spec.vocab_size)
        got = await together(decode.port, requests)
        loop = decode.servicer.generation.step_loop
        assert loop.largest_batch >= 4, loop.largest_batch  # shared steps of varying size
        steps = prefill.servicer.runner.steps
        assert steps is not None and steps.largest_batch >= 2, "no prefill step had two jobs"
        engine = prefill.host.engine
        assert isinstance(engine, PagedEngine) and engine.prefill_threads == threads
    want = await alone(directory, requests, prefill_chunk_tokens=chunk)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}: under load {g}, alone {w}"


class LogitsKept:
    """Stand-in wrapper (test-only): the paged engine, keeping every step's logits per request."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.logits: dict[str, list[torch.Tensor]] = {}

    def step_batch(self, sessions: Sequence[Any]) -> list[int]:
        tokens: list[int] = self.inner.step_batch(sessions)
        for s in sessions:
            self.logits.setdefault(s.blocks.request_id, []).append(s.last_logits.clone())
        return tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def step_logits(
    directory: str, requests: Sequence[tuple[list[int], int, SamplingParams | None]], *, at_once: bool, invariant: bool
) -> dict[str, list[torch.Tensor]]:
    built = await asyncio.to_thread(Colocated.build, "paged", directory, 2, 256, batch_invariant=invariant)
    kept = LogitsKept(built.engine)
    colocated = Colocated(built.layout, kept, 256)
    runs = [colocated.generate(f"r{i}", p, n, sampling=s or SamplingParams()) for i, (p, n, s) in enumerate(requests)]
    try:
        if at_once:
            await asyncio.gather(*runs)
            assert colocated.step_loop.largest_batch >= 4
        else:
            for run in runs:
                await run
    finally:
        colocated.close()
        built.close()
    return kept.logits


@pytest.mark.parametrize("invariant", [True, False])
async def test_every_steps_logits_under_load_equal_alone_only_with_invariance(
    hf_checkpoint: Callable[[str], str], invariant: bool
) -> None:
    """The same load in the decode service's step loop: with invariance every request's logits
    of every step are bit-identical to its run alone; without (the negative control) some differ."""
    directory = hf_checkpoint("nemotron_h")
    requests = load(320)
    loaded = await step_logits(directory, requests, at_once=True, invariant=invariant)
    single = await step_logits(directory, requests, at_once=False, invariant=invariant)
    assert loaded.keys() == single.keys() and len(loaded) == REQUESTS
    same = [all(torch.equal(x, y) for x, y in zip(loaded[k], single[k])) for k in loaded]
    if invariant:
        assert all(same), [k for k, ok in zip(loaded, same) if not ok]
    else:
        assert not all(same), "batching without invariance changed no bit: the check cannot fail"
