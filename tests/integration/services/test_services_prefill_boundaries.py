"""Prefix reuse on prefill (prefill_svc/boundary_cache.py) with the paged engine, on by default
with --prefill-chunk-tokens: a conversation's second turn (turn 1, its output, new text) resumes
at the longest chunk boundary prefill kept and computes only the chunks after it, and its tokens
equal the colocated run of the whole prompt from token 0 with the same chunks. Also with other
block sizes on the two sides (and decode's own prefix cache on: the turn moves fewer bytes than
cold), with a full cache (a job takes the boundaries' blocks back at once), and with everything
freed at the end but the boundaries' own blocks. Real services in this process (grpc.aio on
port 0, NIXL READs over UCX on DRAM), tiny seeded checkpoints.

The negative control of the exactness is tests/integration/exactness/test_resume_at_boundary.py
(another boundary's state, or none, gives other bits); here a job that skips the restore ends
with tokens other than colocated's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from prefill_svc.boundary_cache import BoundaryCache
from shared.engine.paged.engine import PagedEngine, PagedPrefillRun
from shared.engine.protocol import PrefillChunk
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.integration.services.colocated_tokens import colocated_tokens
from tests.integration.services.hf_services import generate_ids, hf_pair
from tests.integration.services.test_services_logprobs import generate_all

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

CHUNK = 20
ANSWER = 4
CHUNKS = ("--prefill-chunk-tokens", str(CHUNK))
ONE_MANIFEST = ("--manifest-parts", "false")  # the job computes in batched steps, not in parts


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 200, n)]


def _metric(prefill: PrefillApp, name: str) -> float:
    value = prefill.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


COMPUTED: list[int] = [0]  # prompt tokens the paged engine's prefill chunks computed (this process)


@pytest.fixture(autouse=True)
def _count_prefill_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefill chunk, in batched steps or in parts, goes through `prefill_batch`."""
    inner = PagedEngine.prefill_batch

    def counted(self: PagedEngine, chunks: Sequence[PrefillChunk]) -> list[int | None]:
        for c in chunks:
            assert isinstance(c.run, PagedPrefillRun)
            COMPUTED[0] += c.end - c.run.computed
        return inner(self, chunks)

    monkeypatch.setattr(PagedEngine, "prefill_batch", counted)


def _computed(prefill: PrefillApp) -> float:
    """Prompt tokens prefill chunks computed so far (colocated runs count too: read around a turn)."""
    return COMPUTED[0]


def _moved(summary: dpb.GenerateSummary) -> int:
    t = summary.transfer
    return t.attention_bytes + t.conv_bytes + t.ssm_bytes


def _cache(prefill: PrefillApp) -> BoundaryCache:
    return prefill.servicer.runner.boundaries


async def _two_turns(
    prefill: PrefillApp, decode: DecodeApp, seed: int
) -> tuple[list[int], list[int], dpb.GenerateSummary, float, float]:
    """Turn 1, then turn 2 extending it: (turn 2's prompt, its tokens, its summary, the prompt
    tokens prefill computed for it and those it skipped)."""
    first = _tokens(seed, 50)
    turn1, _ = await generate_ids(decode.port, first, ANSWER)
    second = [*first, *turn1, *_tokens(seed + 1, 30)]
    computed, skipped = _computed(prefill), _metric(prefill, "hybrid_pd_prefill_boundary_skipped_tokens_total")
    ids, summary = await generate_ids(decode.port, second, ANSWER)
    computed = _computed(prefill) - computed
    skipped = _metric(prefill, "hybrid_pd_prefill_boundary_skipped_tokens_total") - skipped
    return second, ids, summary, computed, skipped


async def _all_but_boundaries_freed(prefill: PrefillApp, *, kept: bool = True) -> None:
    """Nothing pinned or in use on prefill but the boundaries' own blocks, none of them in use;
    once they are given back, nothing at all."""
    for _ in range(1000):  # decode's release reaches prefill after the last response
        if not len(prefill.pins) and prefill.host.allocator.num_used == _cache(prefill).num_blocks:
            break
        await asyncio.sleep(0.01)
    cache = _cache(prefill)
    assert not len(prefill.pins)
    assert prefill.host.allocator.num_used == cache.num_blocks
    assert cache.num_blocks > 0 or not kept
    assert all(b.users == 0 for b in cache._entries.values())
    cache.reclaim(prefill.host.num_blocks)
    assert len(cache) == 0 and prefill.host.allocator.num_used == 0


@pytest.mark.parametrize(("parts", "prefill_tp"), [(False, 1), (True, 1), (True, 2)], ids=["steps", "parts", "parts-tp2"])
async def test_a_second_turn_computes_only_its_new_chunks(
    hf_checkpoint: Callable[[str], str], parts: bool, prefill_tp: int
) -> None:
    directory = hf_checkpoint("nemotron_h")
    async with hf_pair(
        directory,
        directory,
        prefill_tp,
        1,
        engine="paged",
        check_state=False,  # decode's check recomputes in one forward, not prefill's chunks
        prefill_flags=(*CHUNKS, "--num-blocks", "64"),  # the boundary cache by default
        decode_flags=("--num-blocks", "128", *(() if parts else ONE_MANIFEST)),
    ) as (prefill, decode):
        cache = _cache(prefill)
        assert cache.enabled and cache.capacity_blocks == 64 // 4
        second, warm, summary, computed, skipped = await _two_turns(prefill, decode, 11)
        n = prefill.host.engine.num_prefill_tokens(len(second))
        assert skipped == 40  # turn 1 computed 50 tokens: its last boundary is 40
        assert computed == n - skipped
        assert summary.digests_verified
        await _all_but_boundaries_freed(prefill)
    want = await colocated_tokens("paged", directory, second, ANSWER, prefill_chunk_tokens=CHUNK)
    assert warm == want


async def test_other_block_sizes_and_decode_prefix_cache(hf_checkpoint: Callable[[str], str]) -> None:
    """Prefill blocks of 64 tokens, decode blocks of 32 (the boundary at 40 ends inside a block on
    both sides), decode's prefix cache on: turn 2 resumes on prefill and moves fewer bytes."""
    directory = hf_checkpoint("nemotron_h")
    decode_cache = ("--prefix-cache-blocks", "32", "--prefix-cache-states", "0")
    async with hf_pair(
        directory,
        directory,
        1,
        1,
        engine="paged",
        check_state=False,
        prefill_flags=(*CHUNKS, "--num-blocks", "64", "--block-size", "64"),
        decode_flags=("--num-blocks", "128", "--block-size", "32", *decode_cache),
    ) as (prefill, decode):
        assert prefill.host.layout.block_size != decode.host.layout.block_size
        second, warm, summary, _, skipped = await _two_turns(prefill, decode, 21)
        assert skipped == 40 and summary.prefix_cached_tokens > 0
    async with hf_pair(
        directory,
        directory,
        1,
        1,
        engine="paged",
        check_state=False,
        prefill_flags=(*CHUNKS, "--num-blocks", "64", "--block-size", "64", "--prefix-cache-blocks", "0"),
        decode_flags=("--num-blocks", "128", "--block-size", "32"),
    ) as (cold_prefill, cold_decode):
        assert not _cache(cold_prefill).enabled  # --prefix-cache-blocks 0 turns it off
        cold, cold_summary = await generate_ids(cold_decode.port, second, ANSWER)
        assert _metric(cold_prefill, "hybrid_pd_prefill_boundary_skipped_tokens_total") == 0
    want = await colocated_tokens("paged", directory, second, ANSWER, prefill_chunk_tokens=CHUNK)
    assert warm == cold == want
    assert _moved(summary) < _moved(cold_summary)


async def test_skipping_the_restore_changes_the_tokens(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: a job resumed at the boundary without its state restored (its Mamba
    blocks keep what they held) computes other tokens."""
    monkeypatch.setattr(BoundaryCache, "restore", lambda self, hit, blocks: None)
    directory = hf_checkpoint("nemotron_h")
    async with hf_pair(
        directory,
        directory,
        1,
        1,
        engine="paged",
        check_state=False,
        prefill_flags=(*CHUNKS, "--num-blocks", "64"),
        decode_flags=("--num-blocks", "128", *ONE_MANIFEST),
    ) as (prefill, decode):
        second, warm, _, _, skipped = await _two_turns(prefill, decode, 11)
        assert skipped == 40
    want = await colocated_tokens("paged", directory, second, ANSWER, prefill_chunk_tokens=CHUNK)
    assert warm != want


async def test_a_job_takes_the_boundaries_blocks_back(hf_checkpoint: Callable[[str], str]) -> None:
    """The boundaries may hold the whole cache, yet a job that needs their blocks gets them at
    once (least recently used evicted), and a job never waits for them."""
    directory = hf_checkpoint("nemotron_h")
    async with hf_pair(
        directory,
        directory,
        1,
        1,
        engine="paged",
        check_state=False,
        prefill_flags=(*CHUNKS, "--num-blocks", "24", "--prefix-cache-blocks", "24"),
        decode_flags=("--num-blocks", "256", *ONE_MANIFEST),
    ) as (prefill, decode):
        cache, host = _cache(prefill), prefill.host
        for seed in range(4):
            await generate_ids(decode.port, _tokens(100 + seed, 50), ANSWER)
        held = cache.num_blocks
        assert held > 0 and len(cache) >= 2

        # A prompt needing more blocks than are free now (but no more than the cache has).
        def needs(n: int) -> int:
            return sum(host.blocks_per_group(host.engine.num_prefill_tokens(n)))

        length = max(n for n in range(1, 2000) if needs(n) <= host.num_blocks)
        assert needs(length) > host.allocator.num_free
        ids, summary = await generate_ids(decode.port, _tokens(200, length), ANSWER)
        assert len(ids) == ANSWER and summary.digests_verified
        assert _metric(prefill, "hybrid_pd_prefill_boundary_evictions_total") > 0
        await _all_but_boundaries_freed(prefill, kept=False)


async def test_a_job_asking_for_prompt_logprobs_computes_from_token_0(hf_checkpoint: Callable[[str], str]) -> None:
    """Prompt logprobs need every chunk's logits: such a turn 2 resumes nowhere (it still keeps
    its own boundary) and gets a logprob for every prompt token but the first."""
    directory = hf_checkpoint("nemotron_h")
    async with hf_pair(
        directory,
        directory,
        1,
        1,
        engine="paged",
        check_state=False,
        prefill_flags=(*CHUNKS, "--num-blocks", "64"),
        decode_flags=("--num-blocks", "128", *ONE_MANIFEST),
    ) as (prefill, decode):
        first = _tokens(31, 50)
        turn1, _ = await generate_ids(decode.port, first, ANSWER)
        second = [*first, *turn1, *_tokens(32, 30)]
        before, hits = COMPUTED[0], _metric(prefill, "hybrid_pd_prefill_boundary_hits_total")
        ids, _, prompt, _ = await generate_all(
            decode.port, prompt_token_ids=second, max_tokens=ANSWER, logprobs=1, prompt_logprobs=1
        )
        assert COMPUTED[0] - before == prefill.host.engine.num_prefill_tokens(len(second))
        assert _metric(prefill, "hybrid_pd_prefill_boundary_hits_total") == hits
        assert prompt is not None and len(prompt) == len(second) - 1
        assert len(_cache(prefill)) == 2  # turn 1's boundary and turn 2's
    assert ids == await colocated_tokens("paged", directory, second, ANSWER, prefill_chunk_tokens=CHUNK)
