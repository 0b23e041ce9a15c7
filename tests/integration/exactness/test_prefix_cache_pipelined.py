"""Decode's prefix cache (--prefix-cache-blocks) and pipelined transfer (--prefill-chunk-tokens)
together: multi-turn conversations whose turns come in manifest parts that cover only the
tokens after the cached prefix (the first part starts at `skipped_prompt_tokens`), each part's
READ moving just its own K/V.

Real services in this process (grpc.aio on port 0, NIXL READs over UCX on DRAM), the reference
engine, and the paged engine (nemotron_h in chunks of 16, a size whose prefix K/V is stable in
whole chunks: `subjects.PAGED`). Every turn's tokens equal the colocated run bit for bit, with digests and the recompute
check on; every turn's READ count is its parts times the rank pairs, its attention bytes only
those after the cached prefix; at the end prefill holds no block or pin and decode only the
cache's blocks (none once the cache gives them up). A prefill that ignores the cached count
sends parts from token 0: decode READs them into fresh blocks, never the cache's. A part that
starts inside the skipped prefix is refused. Negative control: with digests off, a byte shifted
in a cached block changes the tokens, so the cached K/V is what the pipelined turn computes from.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import grpc
import pytest

from decode_svc import generation as generation_module
from decode_svc.reader import ReadStats
from prefill_svc import jobs as jobs_module
from prefill_svc import session as session_module
from prefill_svc.jobs import Job
from prefill_svc.part_plan import PartSpan, part_spans
from shared.cache.manifest import Manifest
from shared.engine.protocol import RequestBlocks
from shared.pb.hybridpd.v1 import prefill_service_pb2 as prefill_pb
from tests.integration.exactness.multi_turn import ANSWER, fa_unit_tokens, random_tokens, run_turns
from tests.integration.exactness.pair import RunningPair
from tests.integration.exactness.subjects import PAGED, REFERENCE, Subject, subject_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CHUNK = 20  # smaller than every tiny block: some chunks complete no block
# The prefix cache alone: state checkpoints (on by default with it) off, so every turn READs.
CACHE = ["--prefix-cache-blocks", "64", "--prefix-cache-states", "0", "--check-state"]
# Every subject prefills in chunks smaller than a block: the reference engine in CHUNK (any size
# keeps its prefix stable), the paged one in its own (whole chunks only are stable).
SUBJECTS = [REFERENCE.in_chunks_of(CHUNK), PAGED]
IDS = [s.id for s in SUBJECTS]


def _pairs_read(pair: RunningPair) -> int:
    link = pair.decode.peers.peers[0].link
    assert link is not None
    return len(link.pairs)


async def _only_the_cache_holds_blocks(pair: RunningPair) -> bool:
    """Prefill holds no pin and no block but its kept chunk boundaries' (the paged engine's
    prefix reuse on prefill; none on the reference engine), decode only its prefix cache's blocks
    (polled: the last notifications and decode's cleanup may land just after the last response)."""
    cache = pair.decode.servicer.generation.reuse.prefix
    boundaries = pair.prefill.servicer.runner.boundaries
    for _ in range(1000):
        prefill_idle = not len(pair.prefill.pins) and pair.prefill.host.allocator.num_used == boundaries.num_blocks
        if prefill_idle and pair.decode.host.allocator.num_used == cache.num_blocks:
            return True
        await asyncio.sleep(0.01)
    return False


# decode blocks of 32 tokens, prefill's of 64: the cached prefix may end inside a prefill block
BLOCKS = ["--block-size", "64", "--kernel-block-size", "32"]
CASES = [
    (REFERENCE.in_chunks_of(CHUNK), 1, 1, []),
    (Subject("reference", "tiny-gdn", CHUNK), 1, 2, []),
    (REFERENCE.in_chunks_of(CHUNK), 2, 1, []),
    (REFERENCE.in_chunks_of(CHUNK), 2, 1, BLOCKS),
    (PAGED, 1, 2, []),
    (PAGED, 2, 1, BLOCKS),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "subject,prefill_tp,decode_tp,prefill_layout",
    CASES,
    ids=[c[0].id + ("-blocks" if c[3] else "") + f"-P{c[1]}-D{c[2]}" for c in CASES],
)
async def test_multi_turn_parts_after_the_cached_prefix_equal_colocated(
    subject: Subject, prefill_tp: int, decode_tp: int, prefill_layout: list[str]
) -> None:
    decode_layout = ["--block-size", "32", "--kernel-block-size", "16"] if prefill_layout else []
    async with subject_pair(
        subject,
        prefill_tp,
        decode_tp,
        extra_prefill=prefill_layout,
        extra_decode=[*CACHE, *decode_layout],
    ) as pair:
        results = await run_turns(pair, subject, random_tokens(11, 70), 100, 4, seed=11)
        assert await _only_the_cache_holds_blocks(pair)
        cache = pair.decode.servicer.generation.reuse.prefix
        held = cache.num_blocks
        cache.reclaim(held)  # the cache gives every block up: nothing else is left on decode
        freed = pair.decode.host.allocator.num_used
        d_block, p_block = pair.decode.host.layout.block_size, pair.prefill.host.layout.block_size
        pairs, unit = _pairs_read(pair), fa_unit_tokens(pair)
    assert held > 0 and freed == 0
    first = results[0].summary
    unit_bytes = first.transfer.attention_bytes // -(-first.num_transferred_tokens // unit)
    parted = 0
    for t, (prev, cur) in enumerate(itertools.pairwise(results), start=1):
        s, n = cur.summary, cur.summary.num_transferred_tokens
        cached = prev.summary.num_transferred_tokens // d_block * d_block
        parts = len(part_spans(n, subject.prefill_chunk_tokens, p_block, tokens_from=cached))
        parted += parts > 1
        assert s.prefix_cached_tokens == cached > 0, t
        assert s.transfer.read_count == parts * pairs, t
        assert s.transfer.attention_bytes == unit_bytes * (-(-n // unit) - cached // unit), t
        assert s.transfer.ssm_bytes == first.transfer.ssm_bytes and s.transfer.conv_bytes == first.transfer.conv_bytes
        assert s.digests_verified and s.state_verified
    assert parted >= 2  # the turns after the first really came in parts


def test_parts_start_after_the_cached_prefix() -> None:
    spans = part_spans(157, CHUNK, 32, tokens_from=96)
    assert [(s.compute_to, s.tokens_from, s.tokens_to) for s in spans] == [(140, 96, 128), (157, 128, 157)]
    assert part_spans(157, CHUNK, 64, tokens_from=96)[0].tokens_from == 96  # inside a prefill block
    assert part_spans(96, CHUNK, 32, tokens_from=96) == [PartSpan(96, 96, 96)]  # all cached: one manifest
    assert len(part_spans(120, CHUNK, 32, tokens_from=96)) == 1  # no block completes after the prefix


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_prefill_that_ignores_the_cached_count_sends_parts_read_into_fresh_blocks(
    subject: Subject, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old prefill echoes 0 in every part: decode must READ all of them into blocks of its
    own (the first part decides, before its READ), never the cache's."""
    real = session_module.job_from_message

    def ignoring(job: prefill_pb.PrefillJob, **kw: Any) -> Job:  # TEST-ONLY: an old prefill
        old = prefill_pb.PrefillJob()
        old.CopyFrom(job)
        old.ClearField("cached_prompt_tokens")
        return real(old, **kw)

    read_into: list[set[int]] = []  # the attention blocks each READ of the request wrote into
    real_read = generation_module.read_request

    async def recording(host: Any, link: Any, manifest: Manifest, local: RequestBlocks, **kw: Any) -> ReadStats:
        if manifest.request_id == "old-prefill":
            read_into.append({int(b) for g in host.layout.attention_group_ids for b in local.block_ids[g]})
        return await real_read(host, link, manifest, local, **kw)

    monkeypatch.setattr(generation_module, "read_request", recording)
    prompt = random_tokens(12, 130)
    async with subject_pair(subject, 1, 1, extra_decode=CACHE) as pair:
        first = await pair.generate(prompt, ANSWER, request_id="warm")
        cache = pair.decode.servicer.generation.reuse.prefix
        cached_ids = {b for e in cache._entries.values() for b in e.blocks}
        monkeypatch.setattr(session_module, "job_from_message", ignoring)
        again = await pair.generate(prompt, ANSWER, request_id="old-prefill")
        assert await _only_the_cache_holds_blocks(pair)
        assert {b for e in cache._entries.values() for b in e.blocks} == cached_ids  # untouched, still there
        p_block = pair.prefill.host.layout.block_size
        pairs = _pairs_read(pair)
    assert cached_ids and again.token_ids == first.token_ids
    assert len(read_into) > 1 and not any(blocks & cached_ids for blocks in read_into)  # every part: fresh blocks
    assert again.summary.prefix_cached_tokens == 0
    assert again.summary.transfer.attention_bytes == first.summary.transfer.attention_bytes
    computed = subject.computed(len(prompt))
    assert again.summary.transfer.read_count == len(part_spans(computed, subject.prefill_chunk_tokens, p_block)) * pairs > pairs


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_part_inside_the_skipped_prefix_is_refused(subject: Subject, monkeypatch: pytest.MonkeyPatch) -> None:
    """TEST-ONLY: prefill plans its parts from token 0 although it echoes the cached count: the
    first part would READ over the cache's blocks, so decode refuses it (INTERNAL) and frees all."""
    real = jobs_module.part_spans

    def from_zero(
        computed: int, chunk_tokens: int, block_tokens: int, *, tokens_from: int = 0, part_tokens: int = 0
    ) -> list[PartSpan]:
        return real(computed, chunk_tokens, block_tokens, part_tokens=part_tokens)

    prompt = random_tokens(13, 130)
    async with subject_pair(subject, 1, 1, extra_decode=CACHE) as pair:
        healthy = await pair.generate(prompt, ANSWER, request_id="warm")
        monkeypatch.setattr(jobs_module, "part_spans", from_zero)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pair.generate(prompt, ANSWER, request_id="bad-parts")
        assert await _only_the_cache_holds_blocks(pair)
        monkeypatch.setattr(jobs_module, "part_spans", real)
        again = await pair.generate(prompt, ANSWER, request_id="good-again")
    assert refused.value.code() == grpc.StatusCode.INTERNAL
    assert (refused.value.details() or "").startswith("manifest.part.tokens_from:"), refused.value.details()
    assert again.token_ids == healthy.token_ids and again.summary.prefix_cached_tokens > 0


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_without_digests_a_corrupt_cached_block_changes_the_pipelined_tokens(subject: Subject) -> None:
    """Negative control of the exactness above: the cached bytes are really used with parts."""
    prompt = random_tokens(14, 130)
    off = ["--verify-transfer", "off"]
    async with subject_pair(
        subject,
        1,
        1,
        extra_prefill=off,
        extra_decode=[*off, "--prefix-cache-blocks", "64", "--prefix-cache-states", "0"],
    ) as pair:
        first = await pair.generate(prompt, ANSWER, request_id="warm")
        turn = [*prompt, *first.token_ids, *random_tokens(15, 60)]  # the next turn: in parts after the prefix
        healthy = await pair.generate(turn, 8, request_id="healthy")
        cache = pair.decode.servicer.generation.reuse.prefix
        entry = next(iter(cache._entries.values()))  # TEST-ONLY: shift K of the first cached block in place
        kernel = pair.decode.host.layout.kernel_block_ids([entry.blocks[0]])
        for region in pair.decode.host.views[0].fa:
            region[int(kernel[0]), 0].add_(3.0)
        changed = await pair.generate(turn, 8, request_id="changed")
        p_block = pair.prefill.host.layout.block_size
        pairs = _pairs_read(pair)
    cached = healthy.summary.prefix_cached_tokens
    assert cached > 0 and changed.summary.prefix_cached_tokens >= cached
    spans = part_spans(subject.computed(len(turn)), subject.prefill_chunk_tokens, p_block, tokens_from=cached)
    assert healthy.summary.transfer.read_count == len(spans) * pairs
    assert healthy.summary.transfer.read_count > pairs
    assert changed.token_ids != healthy.token_ids
