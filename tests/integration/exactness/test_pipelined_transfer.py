"""Pipelined transfer (--prefill-chunk-tokens): prefill computes the prompt in chunks and sends a
manifest part after each chunk that made attention blocks final; decode READs each part while
prefill computes on, the SSM / conv state with the last part.

Real services in this process (grpc.aio on port 0, NIXL READs over UCX on DRAM), reference
engine. Tokens must equal a colocated run bit for bit, with every part's digests checked, for
prompts around chunk and block edges at TP pairs 1->1, 2->1, 1->2 and with differing kernel
block sizes; a part is shown READ (its notification counted by prefill) while prefill is held
before its next chunk; a byte flipped in one part fails the request with DATA_LOSS naming that
part; and chunking off, or a decode engine that does not accept parts, sends one manifest.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any

import grpc
import pytest

from prefill_svc.part_plan import part_spans
from shared.cache.manifest import Manifest
from shared.engine.reference.colocated import colocated_generate
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout
from shared.layout.presets import TINY_PRESETS
from shared.runtime.faults import FaultPlan, Injector
from tests.integration.exactness.pair import all_freed, cancel_until_released, drop_part_reads, parts_arrive_late, service_pair
from tests.waiting import until


class HoldAfterPart(Injector):
    """TEST-ONLY: holds prefill after each manifest part but the last (`hold(request_id, index)`)
    before its next chunk is queued; corruption as `inner` says."""

    def __init__(self, hold: Callable[[str, int], Awaitable[None]], inner: Injector | None = None) -> None:
        self.hold, self.inner = hold, inner or Injector()

    def holds(self, step: str, request_id: str) -> bool:
        return step == "between_parts"

    async def part_left(self, request_id: str, index: int) -> None:
        await self.hold(request_id, index)

    def corruption(self, request_id: str) -> str | None:
        return self.inner.corruption(request_id)


pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TEXT = bytes(range(32, 127)) * 3
CHUNK = 20  # smaller than every tiny block (32 or 48 tokens): some chunks complete no block
MAX_TOKENS = 6


def prompt_of(length: int) -> list[int]:
    return list(TEXT[:length])


@cache
def expected(model: str, length: int) -> tuple[int, ...]:
    return tuple(colocated_generate(TINY_PRESETS[model], prompt_of(length), MAX_TOKENS))


def edge_lengths(block_size: int) -> list[int]:
    """One chunk, one past it, around the first and second block edges (prefill computes N-1)."""
    return [CHUNK, CHUNK + 1, block_size, block_size + 1, block_size + 2, 2 * block_size + 1, 3 * block_size + 7]


def parts_of(length: int, block_size: int) -> int:
    return len(part_spans(length - 1, CHUNK, block_size))


CASES = [
    ("tiny-mamba2", 1, 1, 16, 16),
    ("tiny-gdn", 1, 1, 16, 16),
    ("tiny-mamba1", 1, 1, 16, 16),
    ("tiny-mamba2", 2, 1, 16, 16),
    ("tiny-gdn", 1, 2, 16, 16),
    ("tiny-mamba1", 2, 1, 16, 16),
    ("tiny-gdn", 1, 1, 16, 32),  # decode blocks of 64 tokens, prefill's of 48
    ("tiny-mamba2", 2, 1, 32, 16),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model,prefill_tp,decode_tp,prefill_kb,decode_kb", CASES, ids=[f"{m}-P{p}-D{d}-kb{a}-{b}" for m, p, d, a, b in CASES]
)
async def test_pipelined_tokens_equal_colocated(
    model: str, prefill_tp: int, decode_tp: int, prefill_kb: int, decode_kb: int
) -> None:
    block_size = build_engine_layout(TINY_PRESETS[model], prefill_tp, kernel_block_size=prefill_kb).block_size
    lengths = edge_lengths(block_size)
    async with service_pair(
        model,
        prefill_tp,
        decode_tp,
        extra_prefill=["--prefill-chunk-tokens", str(CHUNK), "--kernel-block-size", str(prefill_kb)],
        extra_decode=["--check-state", "--kernel-block-size", str(decode_kb)],
    ) as pair:
        got = await asyncio.gather(*(pair.generate(prompt_of(n), MAX_TOKENS) for n in lengths))
        assert await all_freed(pair)
        pairs_read = len(pair.decode.peers.peers[0].link.pairs)  # type: ignore[union-attr]
    for n, g in zip(lengths, got):
        assert tuple(g.token_ids) == expected(model, n), f"prompt of {n} tokens"
        assert g.summary.digests_verified and g.summary.state_verified
        assert g.summary.transfer.read_count == parts_of(n, block_size) * pairs_read, f"prompt of {n} tokens"
    assert max(parts_of(n, block_size) for n in lengths) >= 3  # the long prompts really came in parts


@pytest.mark.asyncio
async def test_a_part_is_read_while_prefill_holds_before_its_next_chunk(inject_faults: Callable[[Injector], None]) -> None:
    """TEST-ONLY hold after part 1: prefill's NIXL notification of that part's READ arrives while
    the next chunk has not started; released, the request completes exactly."""
    model, length = "tiny-mamba2", 120
    async with service_pair(model, 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        router = pair.prefill.host.poller.router
        held, release = asyncio.Event(), asyncio.Event()
        computed_at_hold: list[int] = []

        async def hold(request_id: str, index: int) -> None:
            if index == 0:
                computed_at_hold.append(router.received)
                held.set()
                await release.wait()

        inject_faults(HoldAfterPart(hold))
        call = asyncio.ensure_future(pair.generate(prompt_of(length), MAX_TOKENS))
        await asyncio.wait_for(held.wait(), 60)
        for _ in range(500):  # part 1's READ notifies prefill while prefill still holds
            if router.received > computed_at_hold[0]:
                break
            await asyncio.sleep(0.01)
        notified_while_held = router.received - computed_at_hold[0]
        still_held = not call.done()
        release.set()
        got = await call
    assert notified_while_held == 1 and still_held
    assert tuple(got.token_ids) == expected(model, length)


@pytest.mark.asyncio
@pytest.mark.parametrize("section,part", [("fa", "part 1 of"), ("ssm", "part 3 of 3")])
async def test_a_flipped_byte_in_a_part_fails_naming_the_part(
    inject_faults: Callable[[Injector], None], section: str, part: str
) -> None:
    inject_faults(FaultPlan(corrupt=f"{section}:victim-"))
    length = 100  # 99 computed, blocks of 32, chunks of 20: parts [0,32) [32,64) [64,99)
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        healthy = await pair.generate(prompt_of(length), MAX_TOKENS)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await pair.generate(prompt_of(length), MAX_TOKENS, request_id="victim-1")
        assert await all_freed(pair)  # on prefill once decode's READs of every part are released
    assert tuple(healthy.token_ids) == expected("tiny-mamba2", length)
    assert failed.value.code() == grpc.StatusCode.DATA_LOSS
    details = failed.value.details() or ""
    assert "victim-1" in details and part in details and f"prefill rank 0, {section} of layer group" in details, details


@pytest.mark.asyncio
async def test_a_failed_part_ends_the_request_while_prefill_still_computes(
    inject_faults: Callable[[Injector], None],
) -> None:
    """Part 1's digest check fails while prefill is held before its next chunk (TEST-ONLY hold,
    never let go before the answer): the request fails DATA_LOSS at once, not when the last part
    would arrive; the job is stopped, and once prefill goes on everything is free."""
    inject_faults(FaultPlan(corrupt="fa:victim-"))
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        release = asyncio.Event()
        holding: list[int] = []

        async def hold(request_id: str, index: int) -> None:
            holding.append(index)
            await release.wait()

        inject_faults(HoldAfterPart(hold, FaultPlan(corrupt="fa:victim-")))
        call = asyncio.ensure_future(pair.generate(prompt_of(100), MAX_TOKENS, request_id="victim-early"))
        try:
            failed = await asyncio.wait_for(asyncio.gather(call, return_exceptions=True), 60)
        finally:
            held_throughout = holding == [0] and not release.is_set()
            release.set()
        inject_faults(FaultPlan(corrupt="fa:victim-"))
        freed = await all_freed(pair)
        ended = dict(pair.prefill.pins.ended)
    error = failed[0]
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.DATA_LOSS, error
    assert held_throughout and "part 1 of" in (error.details() or "")
    assert freed and ended.get("released") == 1, ended


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "prefill_flags,decode_flags", [([], []), (["--prefill-chunk-tokens", str(CHUNK)], ["--manifest-parts", "off"])]
)
async def test_without_chunking_or_parts_one_manifest(prefill_flags: list[str], decode_flags: list[str]) -> None:
    length = 100
    async with service_pair("tiny-gdn", 1, 1, extra_prefill=prefill_flags, extra_decode=decode_flags) as pair:
        got = await pair.generate(prompt_of(length), MAX_TOKENS)
    assert tuple(got.token_ids) == expected("tiny-gdn", length)
    assert got.summary.transfer.read_count == 1


def test_part_spans_cover_the_computed_tokens_in_whole_blocks() -> None:
    assert [(s.compute_to, s.tokens_from, s.tokens_to) for s in part_spans(99, 20, 32)] == [
        (40, 0, 32), (80, 32, 64), (99, 64, 99),
    ]  # fmt: skip
    assert len(part_spans(99, 0, 32)) == 1  # off
    assert len(part_spans(20, 20, 32)) == 1  # one chunk
    assert len(part_spans(40, 20, 48)) == 1  # no block completes before the last chunk
    assert len(part_spans(99, 20, 0)) == 1  # no attention group
    spans = part_spans(1000, 64, 48)
    assert spans[0].tokens_from == 0 and spans[-1].tokens_to == 1000
    assert all(a.tokens_to == b.tokens_from for a, b in itertools.pairwise(spans))
    assert all(s.tokens_to % 48 == 0 and s.compute_to >= s.tokens_to for s in spans[:-1])


def test_part_tokens_send_fewer_parts_and_always_the_one_before_the_last_chunk() -> None:
    def plan(computed: int, **kw: int) -> list[tuple[int, int, int]]:
        return [(s.compute_to, s.tokens_from, s.tokens_to) for s in part_spans(computed, 64, 16, **kw)]

    assert plan(1000, part_tokens=256) == [
        (256, 0, 256), (512, 256, 512), (768, 512, 768), (960, 768, 960), (1000, 960, 1000),
    ]  # fmt: skip
    assert plan(1000, part_tokens=10**6) == [(960, 0, 960), (1000, 960, 1000)]  # one part before the last chunk
    assert plan(1000, tokens_from=320, part_tokens=256) == [
        (576, 320, 576), (832, 576, 832), (960, 832, 960), (1000, 960, 1000),
    ]  # fmt: skip
    assert plan(1000, part_tokens=0) == plan(1000) and len(plan(1000)) == 16  # 0: a part after every chunk
    assert plan(1000, part_tokens=1) == plan(1000)
    # Blocks larger than chunks: the chunk before the last leaves a part only if it completed a new block.
    assert [(s.compute_to, s.tokens_from, s.tokens_to) for s in part_spans(99, 20, 48, part_tokens=10**6)] == [
        (80, 0, 48), (99, 48, 99),
    ]  # fmt: skip
    assert [(s.compute_to, s.tokens_from, s.tokens_to) for s in part_spans(99, 20, 48, part_tokens=48)] == [
        (60, 0, 48), (99, 48, 99),
    ]  # fmt: skip


@pytest.mark.asyncio
async def test_parts_of_at_least_part_tokens_equal_colocated() -> None:
    """--manifest-part-tokens: fewer, larger parts, the same tokens; decode READs each part once."""
    model, part_tokens = "tiny-mamba2", 64
    block_size = build_engine_layout(TINY_PRESETS[model], 1, kernel_block_size=16).block_size
    lengths = [3 * block_size + 7, 6 * block_size + 1, 9 * block_size + 5]
    flags = ["--prefill-chunk-tokens", str(CHUNK), "--manifest-part-tokens", str(part_tokens)]
    async with service_pair(model, 1, 1, extra_prefill=flags) as pair:
        got = await asyncio.gather(*(pair.generate(prompt_of(n), MAX_TOKENS) for n in lengths))
        assert await all_freed(pair)
    for n, g in zip(lengths, got):
        parts = len(part_spans(n - 1, CHUNK, block_size, part_tokens=part_tokens))
        assert tuple(g.token_ids) == expected(model, n), f"prompt of {n} tokens"
        assert g.summary.digests_verified
        assert g.summary.transfer.read_count == parts, f"prompt of {n} tokens"
    longest = lengths[-1] - 1
    assert 3 <= len(part_spans(longest, CHUNK, block_size, part_tokens=part_tokens)) < parts_of(lengths[-1], block_size)


SYNTHETIC_CASES = [("qwen3.5-0.8b", 2, 1), ("granite-4.0-h-tiny", 1, 2), ("jamba-mini-1.7", 2, 2)]


@pytest.mark.asyncio
@pytest.mark.parametrize("model,prefill_tp,decode_tp", SYNTHETIC_CASES, ids=[f"{m}-P{p}-D{d}" for m, p, d in SYNTHETIC_CASES])
async def test_synthetic_engine_at_real_model_sizes_in_parts_every_byte_checked(
    model: str, prefill_tp: int, decode_tp: int
) -> None:
    """The synthetic engine prefills in chunks too: real-model layouts in parts, every byte compared."""
    block_size = build_engine_layout(load_model(model), prefill_tp).block_size
    length, chunk = 2 * block_size + block_size // 2, block_size // 2
    async with service_pair(
        model,
        prefill_tp,
        decode_tp,
        engine="synthetic",
        num_blocks=32,
        extra_prefill=["--prefill-chunk-tokens", str(chunk)],
        extra_decode=["--check-state"],
    ) as pair:
        got = await pair.generate(list(range(length)), 3)
        assert await all_freed(pair)
        pairs_read = len(pair.decode.peers.peers[0].link.pairs)  # type: ignore[union-attr]
    parts = len(part_spans(length - 1, chunk, block_size))
    assert parts == 3 and got.summary.state_verified and got.summary.digests_verified
    assert got.summary.transfer.read_count == parts * pairs_read
    assert got.summary.first_step_engine_duration.ToNanoseconds() > 0  # n-1: the first token is decode's own


@pytest.mark.asyncio
async def test_negative_control_a_part_left_unread_changes_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """TEST-ONLY: decode drops the READ of the first part (digests off, so nothing else notices):
    the tokens must differ from colocated, so the exactness test above can fail."""
    drop_part_reads(monkeypatch, lambda part: part.part is not None and part.part.index == 0)
    off = ["--verify-transfer", "off"]
    length = 100
    async with service_pair(
        "tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK), *off], extra_decode=off
    ) as pair:
        got = await pair.generate(prompt_of(length), MAX_TOKENS)
    assert tuple(got.token_ids) != expected("tiny-mamba2", length)


@pytest.mark.asyncio
@pytest.mark.parametrize("part_arrives_late", [False, True])
async def test_a_request_cancelled_between_parts_frees_both_sides(
    inject_faults: Callable[[Injector], None], monkeypatch: pytest.MonkeyPatch, part_arrives_late: bool
) -> None:
    """The client goes away while prefill holds after part 1 (already READ): decode releases the
    request once that part's READs are released, prefill stops the job, and every block is free.

    The late case makes part 1 reach decode's session half a second after it left prefill: a
    cancel as soon as prefill holds would then find decode without the part (it cancels the job:
    the other path) every time."""
    if part_arrives_late:
        parts_arrive_late(monkeypatch, "gone-1")
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        held, release = asyncio.Event(), asyncio.Event()

        async def hold(request_id: str, index: int) -> None:
            held.set()
            await release.wait()

        inject_faults(HoldAfterPart(hold))
        call = asyncio.ensure_future(pair.generate(prompt_of(120), MAX_TOKENS, request_id="gone-1"))
        await asyncio.wait_for(held.wait(), 60)
        # Prefill holds once part 1 is on the stream, not once decode has it: cancel only when
        # decode has taken the part (before, decode cancels the job, a different path).
        session = pair.decode.peers.peers[0].session
        assert session is not None
        await until(lambda: session.has_parts("gone-1"), "decode to take part 1", timeout=60)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        await all_freed(pair)
        freed = (pair.prefill.host.allocator.num_used, pair.decode.host.allocator.num_used, len(pair.prefill.pins))
        ended = dict(pair.prefill.pins.ended)
        release.set()
        inject_faults(Injector())
        healthy = await pair.generate(prompt_of(120), MAX_TOKENS)
    assert freed == (0, 0, 0) and ended.get("released") == 1, (freed, ended)
    assert tuple(healthy.token_ids) == expected("tiny-mamba2", 120)


@pytest.mark.asyncio
async def test_the_next_chunk_is_queued_before_a_part_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compute thread must not wait for the event loop between chunks: chunk k+1 is queued
    before part k is turned into its message. The message of part 0 waits (blocking the loop, at
    most 10 s) for chunk 1 to start on the compute thread; queued only after the part left, it
    never would, and the request would then equal colocated all the same (a pure ordering test)."""
    import threading

    import prefill_svc.session as session
    from prefill_svc.parted_job import PartedJob

    started_after_first = threading.Event()
    compute_span = PartedJob.compute_span

    def spy_span(self: PartedJob, job: Any, run: Any, blocks: Any, start: int, *rest: Any) -> Any:
        if start > 0:
            started_after_first.set()
        return compute_span(self, job, run, blocks, start, *rest)

    seen: list[bool] = []
    to_message = session.manifest_message

    def message_of(m: Manifest) -> Any:
        if m.part is not None and m.part.index == 0:
            seen.append(started_after_first.wait(10))
        return to_message(m)

    monkeypatch.setattr(PartedJob, "compute_span", spy_span)
    monkeypatch.setattr(session, "manifest_message", message_of)
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        got = await pair.generate(prompt_of(120), MAX_TOKENS)
    assert seen == [True]
    assert tuple(got.token_ids) == expected("tiny-mamba2", 120)


@pytest.mark.asyncio
async def test_the_span_after_next_is_queued_before_the_loop_sees_a_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """One span is always queued ahead: span 1 must start on the compute thread while the event
    loop is still blocked right after span 0's result (a callback the compute thread puts on the
    loop before it settles span 0's future waits, at most 10 s, for span 1 to start). Queued only
    once the loop sees span 0's result, it never would, and the request would then equal
    colocated all the same (a pure ordering test)."""
    import threading

    from prefill_svc.parted_job import PartedJob

    loop = asyncio.get_running_loop()
    span_one_started = threading.Event()
    seen: list[bool] = []
    compute_span = PartedJob.compute_span

    def spy_span(self: PartedJob, job: Any, run: Any, blocks: Any, start: int, *rest: Any) -> Any:
        if start > 0:
            span_one_started.set()
        result = compute_span(self, job, run, blocks, start, *rest)
        if start == 0:  # queued before the future's own settling: the loop runs it first
            loop.call_soon_threadsafe(lambda: seen.append(span_one_started.wait(10)))
        return result

    monkeypatch.setattr(PartedJob, "compute_span", spy_span)
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        got = await pair.generate(prompt_of(120), MAX_TOKENS)
    assert seen == [True]
    assert tuple(got.token_ids) == expected("tiny-mamba2", 120)


@pytest.mark.asyncio
async def test_a_part_is_digested_beside_the_next_chunk_not_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host cache, part 0's digests must not hold up the compute thread: they are taken on
    the digest thread while span 1 computes (the digest of part 0 waits, at most 10 s, for span 1
    to start; taken on the compute thread before span 1, it never would, and the request would
    then equal colocated all the same: a pure ordering test). The last part's digests stay on
    the compute thread, right after the last chunk."""
    import threading

    from prefill_svc.parted_job import PartedJob

    span_one_started = threading.Event()
    compute_span, digest_span = PartedJob.compute_span, PartedJob.digest_span
    seen: list[tuple[bool, bool, str]] = []  # (last, span 1 had started, thread)

    def spy_span(self: PartedJob, job: Any, run: Any, blocks: Any, start: int, *rest: Any) -> Any:
        if start > 0:
            span_one_started.set()
        return compute_span(self, job, run, blocks, start, *rest)

    def spy_digest(self: PartedJob, job: Any, blocks: Any, span: Any, last: bool, layers: Any = None) -> Any:
        started = span_one_started.wait(10) if span.tokens_from == 0 else span_one_started.is_set()
        seen.append((last, started, threading.current_thread().name))
        return digest_span(self, job, blocks, span, last, layers)

    monkeypatch.setattr(PartedJob, "compute_span", spy_span)
    monkeypatch.setattr(PartedJob, "digest_span", spy_digest)
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        got = await pair.generate(prompt_of(120), MAX_TOKENS)
    assert tuple(got.token_ids) == expected("tiny-mamba2", 120)
    assert len(seen) == parts_of(120, 32) > 2, seen
    assert seen[0][1], "part 0's digests were taken before span 1 started"
    assert [thread.startswith("digest") for _, _, thread in seen] == [not last for last, _, _ in seen], seen


@pytest.mark.asyncio
@pytest.mark.parametrize("digest_starts_late", [False, True])
async def test_a_release_while_a_part_is_digested_frees_the_blocks_only_after_the_digest(
    monkeypatch: pytest.MonkeyPatch, digest_starts_late: bool
) -> None:
    """The client goes away while part 1's digests are held on the digest thread and the compute
    thread is done with the span queued ahead: the pin ends, but the blocks stay until the
    digests are done with them (freed then, everything ends free); the next request is exact.

    The span ahead waits for the digest thread to hold part 1 before it ends: both start once
    part 1 is computed, in either order. The late case makes the span end first without that
    wait (the digest thread starts half a second late)."""
    import threading
    import time

    from prefill_svc.parted_job import PartedJob

    in_digest, go_on, ahead_done = threading.Event(), threading.Event(), threading.Event()
    compute_span, digest_span = PartedJob.compute_span, PartedJob.digest_span
    digested: list[int] = []
    ahead_from = 64  # blocks of 32: part 1 is [32, 64), the span queued ahead of its digests starts there

    def spy_span(self: PartedJob, job: Any, run: Any, blocks: Any, start: int, span: Any, *rest: Any) -> Any:
        result = compute_span(self, job, run, blocks, start, span, *rest)
        if job.request_id == "gone-3" and span.tokens_from == ahead_from and in_digest.wait(30):
            ahead_done.set()  # the span queued ahead of part 1's digests is computed
        return result

    def spy_digest(self: PartedJob, job: Any, blocks: Any, span: Any, last: bool, layers: Any = None) -> Any:
        if job.request_id == "gone-3":
            digested.append(span.tokens_from)
            if len(digested) == 2:
                if digest_starts_late:
                    time.sleep(0.5)
                in_digest.set()
                go_on.wait(30)
        return digest_span(self, job, blocks, span, last, layers)

    monkeypatch.setattr(PartedJob, "compute_span", spy_span)
    monkeypatch.setattr(PartedJob, "digest_span", spy_digest)
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        call = asyncio.ensure_future(pair.generate(prompt_of(120), MAX_TOKENS, request_id="gone-3"))
        try:
            for _ in range(6000):
                if in_digest.is_set() and ahead_done.is_set() and pair.decode.host.allocator.num_used:
                    break
                await asyncio.sleep(0.01)
            assert in_digest.is_set() and ahead_done.is_set()
            released = await cancel_until_released(pair, call, "gone-3")  # while part 1 is still digested
            held_while_released = pair.prefill.host.allocator.num_used > 0
        finally:
            go_on.set()
        freed = await all_freed(pair)
        healthy = await pair.generate(prompt_of(120), MAX_TOKENS)
    assert released and freed
    assert held_while_released  # the digest thread was still reading them
    assert len(digested) == 2, digested  # no part after the release was digested
    assert tuple(healthy.token_ids) == expected("tiny-mamba2", 120)


@pytest.mark.asyncio
@pytest.mark.parametrize("part_arrives_late", [False, True])
async def test_a_release_mid_prompt_stops_the_spans_queued_ahead_and_frees_everything(
    monkeypatch: pytest.MonkeyPatch, part_arrives_late: bool
) -> None:
    """The client goes away while span 1 computes (held there on the compute thread, span 2
    queued behind it): decode releases the request, and once span 1 is let go no later span
    computes, the blocks are freed only then, and everything ends free; the next request is exact.

    The client goes only once decode has part 0 (`cancel_until_released`); the late case makes
    the part reach decode half a second after it left prefill, which a fixed sleep would miss."""
    import threading

    from prefill_svc.parted_job import PartedJob

    in_span_one, go_on = threading.Event(), threading.Event()
    starts: list[int] = []
    compute_span = PartedJob.compute_span

    def spy_span(self: PartedJob, job: Any, run: Any, blocks: Any, start: int, *rest: Any) -> Any:
        if job.request_id == "gone-2":
            starts.append(start)
            if len(starts) == 2:
                in_span_one.set()
                go_on.wait(30)
        return compute_span(self, job, run, blocks, start, *rest)

    monkeypatch.setattr(PartedJob, "compute_span", spy_span)
    if part_arrives_late:
        parts_arrive_late(monkeypatch, "gone-2")
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=["--prefill-chunk-tokens", str(CHUNK)]) as pair:
        call = asyncio.ensure_future(pair.generate(prompt_of(120), MAX_TOKENS, request_id="gone-2"))
        try:
            for _ in range(6000):
                if in_span_one.is_set() and pair.decode.host.allocator.num_used:
                    break
                await asyncio.sleep(0.01)
            await cancel_until_released(pair, call, "gone-2")  # while span 1 still computes
            held_while_released = pair.prefill.host.allocator.num_used > 0
        finally:
            go_on.set()
        freed = await all_freed(pair)
        ended = dict(pair.prefill.pins.ended)
        starts_at_end = list(starts)
        healthy = await pair.generate(prompt_of(120), MAX_TOKENS)
    assert ended.get("released") == 1 and freed, ended
    assert held_while_released  # the blocks stayed until the compute thread was done with them
    assert len(starts_at_end) == 2, starts_at_end  # span 2 was queued ahead, but never computed
    assert tuple(healthy.token_ids) == expected("tiny-mamba2", 120)
