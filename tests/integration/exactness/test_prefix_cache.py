"""Decode's prefix cache (--prefix-cache-blocks): multi-turn conversations where every turn
extends the previous turn's prompt and answer. Each turn's tokens equal the colocated run bit
for bit, and its READ moves only the K/V after the cached prefix (plus the conv / SSM state).

Negative controls: a byte flipped in a cached block fails the next turn with DATA_LOSS (and the
entry leaves the cache); with digests off the same flip changes the tokens, so the cached bytes
are what decode computes from. Eviction under a small cache falls back to a full READ.

Each test runs on the reference engine (tiny-mamba2; the first also tiny-gdn) and on the paged
engine (nemotron_h, prefill in chunks of 16: `subjects.PAGED`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from prefill_svc import session as session_module
from prefill_svc.jobs import Job
from shared.pb.hybridpd.v1 import prefill_service_pb2 as prefill_pb
from tests.integration.exactness.multi_turn import ANSWER, fa_unit_tokens, random_tokens, run_turns
from tests.integration.exactness.pair import Generated, RunningPair
from tests.integration.exactness.subjects import PAGED, REFERENCE, Subject, subject_pair
from tests.metric_samples import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# The prefix cache alone: state checkpoints (on by default with it) off, so every turn READs.
NO_STATES = ["--prefix-cache-states", "0"]
CACHE = ["--prefix-cache-blocks", "64", *NO_STATES, "--check-state"]
SUBJECTS = [REFERENCE, PAGED]
IDS = [s.id for s in SUBJECTS]


def _conversation(seed: int, first: int, added: int) -> tuple[list[int], int]:
    return random_tokens(seed, first), added


def _metric(pair: RunningPair, name: str) -> float:
    return sample(pair.decode.metrics.telemetry.exposition(), name)


def _check_bytes(results: Sequence[Generated], block_size: int, unit: int) -> None:
    """Turn t READs the K/V of its computed tokens after the previous turn's full blocks only."""
    first = results[0].summary
    n1 = first.num_transferred_tokens
    assert first.prefix_cached_tokens == 0
    unit_bytes = first.transfer.attention_bytes // -(-n1 // unit)
    for prev, cur in itertools.pairwise(results):
        s = cur.summary
        cached = prev.summary.num_transferred_tokens // block_size * block_size
        assert s.prefix_cached_tokens == cached > 0
        assert s.transfer.attention_bytes == unit_bytes * (-(-s.num_transferred_tokens // unit) - cached // unit)
        assert s.transfer.ssm_bytes == first.transfer.ssm_bytes and s.transfer.conv_bytes == first.transfer.conv_bytes
        assert s.digests_verified and s.state_verified


FIRST = [REFERENCE, Subject("reference", "tiny-gdn"), PAGED]


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", FIRST, ids=[s.id for s in FIRST])
async def test_every_turn_reads_only_what_follows_the_cached_prefix(subject: Subject) -> None:
    prompt, added = _conversation(1, 70, 40)
    async with subject_pair(subject, 1, 1, extra_decode=CACHE) as pair:
        results = await run_turns(pair, subject, prompt, added, 4, seed=1)
        _check_bytes(results, pair.decode.host.layout.block_size, fa_unit_tokens(pair))
        assert _metric(pair, "hybrid_pd_prefix_cache_hits_total") == 3
        assert _metric(pair, "hybrid_pd_prefix_cache_misses_total") == 1
        saved = _metric(pair, "hybrid_pd_prefix_cache_saved_bytes_total")
        assert saved > 0 and _metric(pair, "hybrid_pd_prefix_cache_evictions_total") == 0
        held = pair.decode.servicer.generation.reuse.prefix.num_blocks
        assert held > 0 and pair.decode.host.allocator.num_used == held  # nothing else outlives a request


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_different_block_sizes_on_the_two_sides(subject: Subject) -> None:
    prompt, added = _conversation(2, 90, 50)
    prefill = ["--block-size", "64", "--kernel-block-size", "32", "--tp", "2"]
    decode = [*CACHE, "--block-size", "32", "--kernel-block-size", "16"]
    async with subject_pair(subject, 2, 1, extra_prefill=prefill, extra_decode=decode) as pair:
        assert pair.decode.host.layout.block_size != pair.prefill.host.layout.block_size
        results = await run_turns(pair, subject, prompt, added, 3, seed=2)
        _check_bytes(results, pair.decode.host.layout.block_size, fa_unit_tokens(pair))


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_an_evicted_prefix_falls_back_to_a_full_read(subject: Subject) -> None:
    a, added = _conversation(3, 70, 30)
    b, _ = _conversation(4, 70, 30)
    async with subject_pair(subject, 1, 1, extra_decode=["--prefix-cache-blocks", "2", *NO_STATES]) as pair:
        first = await run_turns(pair, subject, a, added, 1, seed=3)
        await run_turns(pair, subject, b, added, 1, seed=4)  # its blocks push a's out
        assert _metric(pair, "hybrid_pd_prefix_cache_evictions_total") == 2
        again = await pair.generate(a, ANSWER, request_id="a-again")
        assert again.token_ids == first[0].token_ids
        assert again.summary.prefix_cached_tokens == 0
        assert again.summary.transfer.attention_bytes == first[0].summary.transfer.attention_bytes
        assert _metric(pair, "hybrid_pd_prefix_cache_misses_total") == 3


def _corrupt_a_cached_block(pair: RunningPair) -> None:
    """TEST-ONLY: shift K of the least recently used cached block in place (a fault no real part
    makes on purpose)."""
    cache = pair.decode.servicer.generation.reuse.prefix
    entry = next(iter(cache._entries.values()))
    kernel = pair.decode.host.layout.kernel_block_ids([entry.blocks[0]])
    for region in pair.decode.host.views[0].fa:
        region[int(kernel[0]), 0].add_(3.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_corrupt_cached_block_fails_the_turn_and_leaves_the_cache(subject: Subject) -> None:
    prompt, _ = _conversation(5, 70, 0)
    async with subject_pair(subject, 1, 1, extra_decode=["--prefix-cache-blocks", "64", *NO_STATES]) as pair:
        healthy = await pair.generate(prompt, ANSWER)
        _corrupt_a_cached_block(pair)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await pair.generate(prompt, ANSWER, request_id="victim")
        assert failed.value.code() == grpc.StatusCode.DATA_LOSS
        assert "prefix cache" in (failed.value.details() or "")
        again = await pair.generate(prompt, ANSWER)  # the corrupt entry is gone: a full READ
        assert again.token_ids == healthy.token_ids and again.summary.prefix_cached_tokens == 0
        assert _metric(pair, "hybrid_pd_prefix_cache_evictions_total") >= 1


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_without_digests_a_corrupt_cached_block_changes_the_tokens(subject: Subject) -> None:
    """The negative control of the exactness above: the cached bytes are really used."""
    prompt, _ = _conversation(6, 70, 0)
    off = ["--verify-transfer", "off"]
    async with subject_pair(
        subject, 1, 1, extra_prefill=off, extra_decode=[*off, "--prefix-cache-blocks", "64", *NO_STATES]
    ) as pair:
        healthy = await pair.generate(prompt, 8)
        _corrupt_a_cached_block(pair)
        changed = await pair.generate(prompt, 8)
        assert changed.summary.prefix_cached_tokens > 0
        assert changed.token_ids != healthy.token_ids


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_prefill_that_ignores_the_cached_count_gets_a_full_read_into_fresh_blocks(
    subject: Subject, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill from before the field reads a job without it: it digests and pins the whole state
    and echoes 0. Decode must then READ everything, and into blocks of its own, never the cache's."""
    real = session_module.job_from_message

    def ignoring(job: prefill_pb.PrefillJob, **kw: Any) -> Job:  # TEST-ONLY: an old prefill
        old = prefill_pb.PrefillJob()
        old.CopyFrom(job)
        old.ClearField("cached_prompt_tokens")
        return real(old, **kw)

    prompt, added = _conversation(7, 70, 40)
    async with subject_pair(subject, 1, 1, extra_decode=CACHE) as pair:
        first = (await run_turns(pair, subject, prompt, added, 1, seed=7))[0]
        cache = pair.decode.servicer.generation.reuse.prefix
        cached_ids = {b for e in cache._entries.values() for b in e.blocks}
        monkeypatch.setattr(session_module, "job_from_message", ignoring)
        again = await pair.generate(prompt, ANSWER, request_id="old-prefill")
        assert again.token_ids == first.token_ids
        assert again.summary.prefix_cached_tokens == 0
        assert again.summary.transfer.attention_bytes == first.summary.transfer.attention_bytes
        assert _metric(pair, "hybrid_pd_prefix_cache_hits_total") == 1  # found, then not used
        assert {b for e in cache._entries.values() for b in e.blocks} == cached_ids  # untouched, still there
        assert pair.decode.host.allocator.num_used == cache.num_blocks
