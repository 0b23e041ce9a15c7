"""Pipelined transfer with the hf engine (--prefill-chunk-tokens): prefill runs one forward per
chunk on one transformers cache and sends a manifest part after each chunk that made blocks
final. A continued forward rounds differently from one forward over the whole prompt, so the
baseline is a colocated run with the same chunks: tokens equal bit for bit, every part's
digests checked, and decode's --check-state recomputes in the same chunks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from decode_svc.generation import Generation
from decode_svc.reader import ReadStats
from decode_svc.request import RequestContext
from prefill_svc.job import ComputedState
from prefill_svc.parted_job import PartedJob
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.integration.services.colocated_tokens import CHECKPOINT_ENGINES, colocated_tokens
from tests.integration.services.hf_services import generate_ids, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

CHUNK = 40


@pytest.mark.parametrize("engine", CHECKPOINT_ENGINES)
@pytest.mark.parametrize("family,p_tp,d_tp", [("nemotron_h", 1, 1), ("bamba", 1, 2), ("qwen3_5", 2, 1)])
async def test_hf_pipelined_tokens_equal_colocated_with_the_same_chunks(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, family: str, p_tp: int, d_tp: int, engine: str
) -> None:
    span_seconds: list[float] = []  # the engine seconds of each part's span, as the job measured them
    start_span = PartedJob._start_span  # on the compute thread (hf) or in batched prefill steps (paged)

    def kept(future: asyncio.Future[ComputedState]) -> None:
        if not future.cancelled() and future.exception() is None:
            span_seconds.append(future.result().engine_seconds)

    def recorded(self: PartedJob, index: int) -> asyncio.Future[ComputedState]:
        future = start_span(self, index)
        future.add_done_callback(kept)
        return future

    monkeypatch.setattr(PartedJob, "_start_span", recorded)
    directory = hf_checkpoint(family)
    prompts = [[(7 * i + j) % 300 + 4 for i in range(n)] for j, n in enumerate((CHUNK, CHUNK + 1, 150, 233))]
    flags = ("--prefill-chunk-tokens", str(CHUNK))
    spans: list[list[float]] = []
    got = []
    async with hf_pair(directory, directory, p_tp, d_tp, prefill_flags=flags, engine=engine) as (_, decode):
        for p in prompts:  # one at a time: each request's spans apart
            span_seconds.clear()
            got.append(await generate_ids(decode.port, p, 6))
            spans.append(list(span_seconds))
        pairs = len(decode.peers.peers[0].link.pairs)  # type: ignore[union-attr]
    for prompt, (ids, summary), parts in zip(prompts, got, spans, strict=True):
        want = await colocated_tokens(engine, directory, prompt, 6, prefill_chunk_tokens=CHUNK)
        assert ids == want, len(prompt)
        assert summary.digests_verified
        engine_ns = summary.prefill_engine_duration.ToNanoseconds()
        assert 0 < engine_ns < summary.prefill_duration.ToNanoseconds()
        if parts:  # in parts: the engine time of every part's span, not of the last alone
            assert engine_ns == int(sum(parts) * 1e9), (len(prompt), parts)
    assert len(spans[-1]) > 1  # the longest prompt's engine time was summed over parts
    assert got[0][1].transfer.read_count == pairs  # one chunk: one manifest
    assert got[-1][1].transfer.read_count > pairs  # the longest prompt came in parts


async def test_a_first_token_that_ends_the_request_stops_the_reads_of_its_parts(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_tokens 1 at the full-N boundary: the last part's first token ends the request, so its
    state is never needed. A part's READ still pending then (TEST-ONLY: held forever) must be
    stopped, and prefill's pin released only after, with every block free on both sides."""
    started: list[str] = []

    async def held(self: Generation, req: RequestContext, *args: object) -> ReadStats:
        started.append(req.request_id)
        await asyncio.Event().wait()  # never set: only a cancel ends it
        raise AssertionError("unreachable")

    monkeypatch.setattr(Generation, "_read_part", held)
    directory = hf_checkpoint("nemotron_h")
    prompt = [(7 * i) % 300 + 4 for i in range(233)]
    flags = ("--prefill-chunk-tokens", str(CHUNK))
    async with hf_pair(directory, directory, 1, 1, prefill_flags=flags) as (prefill, decode):
        ids, summary = await generate_ids(decode.port, prompt, 1)
        pending = [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__name__", "") == "held" and not t.done()]
        for _ in range(1000):  # the release travels on the session stream (polled, never timed)
            if not (prefill.host.allocator.num_used or len(prefill.pins) or decode.host.allocator.num_used):
                break
            await asyncio.sleep(0.01)
        freed = (prefill.host.allocator.num_used, len(prefill.pins), decode.host.allocator.num_used)
    assert len(ids) <= 1 and summary.finish_reason in (dpb.FINISH_REASON_LENGTH, dpb.FINISH_REASON_STOP)
    assert started and not pending  # parts arrived, and none of their READs outlived the request
    assert freed == (0, 0, 0)


@pytest.mark.parametrize("engine", CHECKPOINT_ENGINES)
@pytest.mark.parametrize("family,p_tp,d_tp,layer_parts", [("nemotron_h", 1, 1, 3), ("falcon_h1", 1, 2, 2), ("qwen3_5", 2, 1, 4)])
async def test_hf_layer_parts_tokens_equal_colocated_with_the_same_chunks(
    hf_checkpoint: Callable[[str], str], family: str, p_tp: int, d_tp: int, layer_parts: int, engine: str
) -> None:
    """--layer-parts: the last chunk's state leaves layer range by layer range, each as forward
    hooks saw its layers computed; tokens still equal colocated with the same chunks."""
    directory = hf_checkpoint(family)
    prompt = [(7 * i) % 300 + 4 for i in range(233)]
    flags = ("--prefill-chunk-tokens", str(CHUNK), "--layer-parts", str(layer_parts))
    async with hf_pair(directory, directory, p_tp, d_tp, prefill_flags=flags, engine=engine) as (
        prefill,
        decode,
    ):
        ids, summary = await generate_ids(decode.port, prompt, 6)
        unsplit = prefill.servicer.runner.layer_parts
        prefill.servicer.runner.layer_parts = 0  # the same prefill, the last chunk in one part
        _, whole_last = await generate_ids(decode.port, prompt, 6)
    want = await colocated_tokens(engine, directory, prompt, 6, prefill_chunk_tokens=CHUNK)
    assert ids == want and summary.digests_verified and unsplit == layer_parts
    assert summary.transfer.read_count > whole_last.transfer.read_count  # more parts: the layer parts
