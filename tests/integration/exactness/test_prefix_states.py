"""Decode's state checkpoints (--prefix-cache-states): a prompt whose computed tokens are exactly
those of a finished request needs no prefill job and READs nothing; its conv / SSM state (and
the attention blocks the prefix cache does not share) come from the checkpoint. Every response
equals the colocated run bit for bit, with every digest and --check-state on.

Negative controls: a checkpoint's SSM bytes shifted in place are refused with digests on (the
request falls back to prefill and a READ, still exact), and change the tokens with digests off,
so the restored bytes are what decode computes from. A prompt one token shorter or longer than
a cached one finds no checkpoint.

A checkpoint needs no ready prefill engine: with the prefill service stopped (its session lost,
its link closed), a cached prompt still decodes from it, exactly; any other prompt, and one whose
checkpoint fails its digests, fails UNAVAILABLE as every request does without a prefill engine.

Each test runs on the reference engine (tiny-mamba2; the first also tiny-gdn) and on the paged
engine (nemotron_h at its default, the full-N boundary, its prefill in chunks of 16:
`subjects.PAGED`), but the one of several seeds: at full-N the first token's draw keys a
checkpoint, so other seeds miss it by design (test_services_hf_full_n_states.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc
import pytest
import torch

from hybridpd_tools.bench.colocated_server import colocated_servicer
from shared.config import parse_settings
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.rpc.status import describe
from shared.runtime.faults import Injector
from tests.integration.exactness.multi_turn import ANSWER, fa_unit_tokens, random_tokens
from tests.integration.exactness.pair import Generated, RunningPair, service_pair
from tests.integration.exactness.subjects import PAGED, REFERENCE, Subject, subject_pair
from tests.integration.services.checkpoint_checks import (
    checkpoint_pages,
    count_jobs,
    oldest_checkpoint,
    shift_checkpoint_ssm,
)
from tests.integration.services.colocated import colocated_port
from tests.metric_samples import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class HoldAfterRead(Injector):
    """Holds one request after its READ (or restore) until `go` is set."""

    def __init__(self, request_id: str, go: asyncio.Event) -> None:
        self.request_id, self.go = request_id, go

    async def pause(self, step: str, request_id: str) -> None:
        if step == "after_read" and request_id == self.request_id:
            await self.go.wait()


def _states(n: int = 4, check: bool = True) -> list[str]:
    return ["--prefix-cache-blocks", "64", "--prefix-cache-states", str(n), *(["--check-state"] if check else [])]


def _metric(pair: RunningPair, name: str) -> float:
    return sample(pair.decode.metrics.telemetry.exposition(), name)


def _assert_restored(g: Generated, computed: int) -> None:
    s = g.summary
    assert s.prefix_state_reused and s.prefix_cached_tokens == computed
    assert s.num_transferred_tokens == 0 and s.transfer.total_bytes == 0 and s.transfer.read_count == 0
    assert s.digests_verified and s.state_verified


def _assert_read(g: Generated) -> None:
    s = g.summary
    assert not s.prefix_state_reused and s.transfer.ssm_bytes > 0 and s.transfer.read_count > 0


async def _exact(subject: Subject, prompt: Sequence[int], got: Generated) -> None:
    assert got.token_ids == await subject.expected(prompt, ANSWER)


SUBJECTS = [REFERENCE, PAGED]
IDS = [s.id for s in SUBJECTS]
FIRST = [REFERENCE, Subject("reference", "tiny-gdn"), PAGED]


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", FIRST, ids=[s.id for s in FIRST])
async def test_a_repeated_prompt_needs_no_prefill_and_no_read(subject: Subject, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = count_jobs(monkeypatch)
    async with subject_pair(subject, 1, 1, extra_decode=_states()) as pair:
        block = pair.decode.host.layout.block_size
        # 69 computed tokens end inside a block (its copy is the checkpoint's); `block` computed
        # tokens end on a block boundary (every attention block comes from the prefix cache).
        unit, saved, lengths = fa_unit_tokens(pair), 0, []
        for c, seed in ((69, 1), (block, 2)):
            n = subject.prompt_len(c)
            lengths.append(n)
            prompt = random_tokens(seed, n)
            first = await pair.generate(prompt, ANSWER, request_id=f"first-{n}")
            await _exact(subject, prompt, first)
            _assert_read(first)
            # A hit saves what a READ after the prefix cache's full blocks would move: the K/V
            # units from the last full block on, and the conv and SSM state.
            t = first.summary.transfer
            unit_bytes = t.attention_bytes // -(-c // unit)
            saved += 2 * (unit_bytes * (-(-c // unit) - c // block * block // unit) + t.conv_bytes + t.ssm_bytes)
            for again in range(2):
                got = await pair.generate(prompt, ANSWER, request_id=f"again-{n}-{again}")
                assert got.token_ids == first.token_ids
                _assert_restored(got, c)
        assert jobs == [f"first-{n}" for n in lengths]
        assert _metric(pair, "hybrid_pd_prefix_state_hits_total") == 4
        assert _metric(pair, "hybrid_pd_prefix_state_misses_total") == 2
        assert _metric(pair, "hybrid_pd_prefix_state_saved_bytes_total") == saved
        assert _metric(pair, "hybrid_pd_prefix_state_without_prefill_total") == 0  # the prefill was ready for each
        generation = pair.decode.servicer.generation
        assert len(generation.reuse.states) == 2
        # The checkpoints' copies are pool blocks (3: one attention block, two Mamba; 2: Mamba only);
        # the requests' own blocks are all freed.
        reuse, host = generation.reuse, pair.decode.host
        assert reuse.states.num_blocks == 3 + 2
        assert host.allocator.num_used == reuse.prefix.num_blocks + reuse.states.num_blocks
        assert host.reclaim is not None and host.reclaim(host.num_blocks) > 0
        assert host.allocator.num_used == 0 and len(reuse.states) == 0  # cleared: nothing leaks


async def _sampled(pair: RunningPair | pb_grpc.DecodeServiceStub, prompt: list[int], seed: int, rid: str = "") -> Generated:
    stub = pair.stub if isinstance(pair, RunningPair) else pair
    sampling = pb.SamplingParams(seed=seed, temperature=1.3, top_p=0.95, top_k=50) if seed else None
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=12, request_id=rid, sampling=sampling)
    tokens: list[int] = []
    summary = pb.GenerateSummary()
    async for reply in stub.Generate(request, timeout=120):
        if reply.HasField("chunk"):
            tokens.extend(reply.chunk.token_ids)
        else:
            summary = reply.summary
    return Generated(tokens, summary)


@pytest.mark.asyncio
async def test_samples_with_different_seeds_reuse_one_checkpoint_and_equal_colocated(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = count_jobs(monkeypatch)
    prompt = random_tokens(3, 75)
    async with service_pair("tiny-mamba2", 1, 1, extra_decode=_states()) as pair:
        runs = [await _sampled(pair, prompt, seed, f"s{seed}") for seed in (0, 7, 8, 0)]
    assert jobs == ["s0"]
    for g in runs[1:]:
        _assert_restored(g, len(prompt) - 1)
    async with colocated_port(colocated_servicer("reference", "tiny-mamba2", 1, 64)) as port:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            want = [await _sampled(pb_grpc.DecodeServiceStub(channel), prompt, seed) for seed in (0, 7, 8)]
        finally:
            await channel.close()
    assert [g.token_ids for g in runs] == [w.token_ids for w in (*want, want[0])]
    assert len({tuple(w.token_ids) for w in want}) == 3  # the seeds really decide the tokens


TP_CASES = [(REFERENCE, 2, 1), (REFERENCE, 1, 2), (PAGED, 2, 1)]


@pytest.mark.asyncio
@pytest.mark.parametrize("subject,p_tp,d_tp", TP_CASES, ids=[f"{s.id}-P{p}-D{d}" for s, p, d in TP_CASES])
async def test_other_tp_and_block_sizes_on_the_two_sides(
    subject: Subject, p_tp: int, d_tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = count_jobs(monkeypatch)
    prompt = random_tokens(4, 90)
    prefill = ["--block-size", "64", "--kernel-block-size", "32"]
    decode = [*_states(), "--block-size", "32", "--kernel-block-size", "16"]
    async with subject_pair(subject, p_tp, d_tp, extra_prefill=prefill, extra_decode=decode) as pair:
        assert pair.decode.host.layout.block_size != pair.prefill.host.layout.block_size
        first = await pair.generate(prompt, ANSWER, request_id="first")
        again = await pair.generate(prompt, ANSWER, request_id="again")
    await _exact(subject, prompt, first)
    _assert_read(first)
    assert again.token_ids == first.token_ids
    _assert_restored(again, subject.computed(len(prompt)))
    assert jobs == ["first"]


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_prompt_one_token_shorter_or_longer_finds_no_checkpoint(
    subject: Subject, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = count_jobs(monkeypatch)
    prompt = random_tokens(5, 70)
    async with subject_pair(subject, 1, 1, extra_decode=_states()) as pair:
        await pair.generate(prompt, ANSWER, request_id="cached")
        for name, other in (("shorter", prompt[:-1]), ("longer", [*prompt, 17])):
            got = await pair.generate(other, ANSWER, request_id=name)
            await _exact(subject, other, got)
            _assert_read(got)
            assert got.summary.prefix_cached_tokens > 0  # the attention prefix was still reused
        assert jobs == ["cached", "shorter", "longer"]
        assert _metric(pair, "hybrid_pd_prefix_state_hits_total") == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_corrupt_checkpoint_is_refused_and_the_request_prefills(
    subject: Subject, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = count_jobs(monkeypatch)
    prompt = random_tokens(6, 70)
    async with subject_pair(subject, 1, 1, extra_decode=_states()) as pair:
        healthy = await pair.generate(prompt, ANSWER, request_id="healthy")
        shift_checkpoint_ssm(pair.decode)
        fallback = await pair.generate(prompt, ANSWER, request_id="fallback")
        assert fallback.token_ids == healthy.token_ids
        _assert_read(fallback)
        assert _metric(pair, "hybrid_pd_prefix_state_evictions_total") == 1
        again = await pair.generate(prompt, ANSWER, request_id="again")  # the fallback's own checkpoint
        assert again.token_ids == healthy.token_ids
        _assert_restored(again, subject.computed(len(prompt)))
    assert jobs == ["healthy", "fallback"]


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_without_digests_a_corrupt_checkpoint_changes_the_tokens(subject: Subject) -> None:
    """The negative control of the exactness above: the restored bytes are really used."""
    prompt = random_tokens(7, 70)
    off = ["--verify-transfer", "off"]
    async with subject_pair(subject, 1, 1, extra_prefill=off, extra_decode=[*off, *_states(check=False)]) as pair:
        healthy = await pair.generate(prompt, 8)
        shift_checkpoint_ssm(pair.decode)
        changed = await pair.generate(prompt, 8)
    assert changed.summary.prefix_state_reused
    assert changed.token_ids != healthy.token_ids


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_one_checkpoint_two_alternating_prompts_evict_each_other(subject: Subject, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = count_jobs(monkeypatch)
    a, b = random_tokens(8, 70), random_tokens(9, 70)
    async with subject_pair(subject, 1, 1, extra_decode=_states(1)) as pair:
        for i, prompt in enumerate((a, b, a, b)):
            got = await pair.generate(prompt, ANSWER, request_id=f"r{i}")
            await _exact(subject, prompt, got)
            _assert_read(got)
        assert _metric(pair, "hybrid_pd_prefix_state_misses_total") == 4
        assert _metric(pair, "hybrid_pd_prefix_state_hits_total") == 0
        assert _metric(pair, "hybrid_pd_prefix_state_evictions_total") == 3
        assert len(pair.decode.servicer.generation.reuse.states) == 1
    assert len(jobs) == 4


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_checkpoint_in_use_is_never_evicted_or_overwritten(
    subject: Subject, inject_faults: Callable[[Injector], None]
) -> None:
    """A request holds the only checkpoint (paused after its restore) while another request's
    checkpoint wants its place: the held one stays, byte for byte, and the newcomer is not kept."""
    a, b = random_tokens(10, 70), random_tokens(11, 70)
    go = asyncio.Event()
    inject_faults(HoldAfterRead("holder", go))
    async with subject_pair(subject, 1, 1, extra_decode=_states(1)) as pair:
        states = pair.decode.servicer.generation.reuse.states
        first = await pair.generate(a, ANSWER, request_id="first")
        held = oldest_checkpoint(pair.decode)
        before = checkpoint_pages(pair.decode, held)
        holder = asyncio.ensure_future(pair.generate(a, ANSWER, request_id="holder"))
        while held.users == 0:
            await asyncio.sleep(0.01)
        other = await pair.generate(b, ANSWER, request_id="other")  # its checkpoint finds no room
        await _exact(subject, b, other)
        assert list(states._entries.values()) == [held]
        now = checkpoint_pages(pair.decode, held)
        assert all(torch.equal(x, y) for rank, was in zip(now, before) for x, y in zip(rank, was))
        assert _metric(pair, "hybrid_pd_prefix_state_evictions_total") == 0
        go.set()
        reused = await holder
        assert reused.token_ids == first.token_ids
        _assert_restored(reused, subject.computed(len(a)))
        await pair.generate(b, ANSWER, request_id="other-again")  # now it evicts the unused one
        assert _metric(pair, "hybrid_pd_prefix_state_evictions_total") == 1


async def _unavailable(pair: RunningPair, prompt: list[int], request_id: str) -> None:
    """The request fails as every request does while no prefill engine is ready."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pair.generate(prompt, ANSWER, request_id=request_id)
    failure = describe(err.value)
    assert failure.status == "UNAVAILABLE" and failure.reason == "NO_PREFILL_PEER", failure
    assert failure.message.startswith("no prefill engine is ready (127.0.0.1:"), failure


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_checkpointed_prompt_decodes_with_its_prefill_stopped(subject: Subject, monkeypatch: pytest.MonkeyPatch) -> None:
    """The only prefill service is stopped after two checkpoints were taken (the older one's SSM
    bytes then shifted): the intact one is restored and decoded, bit for bit as before; a prompt
    with no checkpoint, and the corrupt one (it would need the job after all), fail UNAVAILABLE
    naming the peer, nothing counted as a lookup and nothing left held."""
    jobs = count_jobs(monkeypatch)
    corrupt, prompt, other = random_tokens(19, 75), random_tokens(20, 70), random_tokens(21, 70)
    # No fallback: decode would compute `other` itself (test_services_local_prefill.py).
    async with subject_pair(subject, 1, 1, extra_decode=[*_states(), "--local-prefill", "off"]) as pair:
        await pair.generate(corrupt, ANSWER, request_id="corrupt")
        first = await pair.generate(prompt, ANSWER, request_id="first")
        shift_checkpoint_ssm(pair.decode)  # the oldest: `corrupt`'s
        assert _metric(pair, "hybrid_pd_prefix_state_without_prefill_total") == 0
        await pair.prefill.stop()
        peers, host = pair.decode.servicer.generation.peers, pair.decode.host
        reuse = pair.decode.servicer.generation.reuse
        while peers.any_ready or any(p.link is not None for p in peers.peers):
            await asyncio.sleep(0.02)
        assert [link.closed for link in peers.known_links()] == [True]  # its agents removed: nothing to READ from
        for again in range(2):
            got = await pair.generate(prompt, ANSWER, request_id=f"again-{again}")
            assert got.token_ids == first.token_ids
            _assert_restored(got, subject.computed(len(prompt)))
            assert got.summary.prefill_engine_id == first.summary.prefill_engine_id
        await _unavailable(pair, other, "other")
        await _unavailable(pair, corrupt, "corrupt-again")  # its restore fails the digests: it would need a job
        assert jobs == ["corrupt", "first"]
        assert _metric(pair, "hybrid_pd_prefix_state_hits_total") == 3  # again-0, again-1, corrupt-again
        assert _metric(pair, "hybrid_pd_prefix_state_misses_total") == 2  # the first two; `other` looked nothing up
        assert _metric(pair, "hybrid_pd_prefix_state_evictions_total") == 1  # the corrupt one, discarded
        assert _metric(pair, "hybrid_pd_prefix_state_without_prefill_total") == 2  # again-0, again-1 (not the failures)
        assert len(reuse.states) == 1 and all(c.users == 0 for c in reuse.states._entries.values())
        assert all(e.users == 0 for e in reuse.prefix._entries.values())
        assert host.allocator.num_used == reuse.prefix.num_blocks + reuse.states.num_blocks
        assert host.reclaim is not None and host.reclaim(host.num_blocks) > 0
        assert host.allocator.num_used == 0  # cleared: nothing leaks
    await _exact(subject, prompt, first)


def test_states_without_the_prefix_cache_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "tiny-mamba2", "--prefill", "127.0.0.1:1"]
    with pytest.raises(SystemExit):
        parse_settings("decode", [*base, "--prefix-cache-blocks", "0", "--prefix-cache-states", "2"], environ={})
    assert "needs the prefix cache (--prefix-cache-blocks is 0)" in capsys.readouterr().err
    # The prefix cache is on by default: states alone are fine (its size is decided at start-up).
    alone = parse_settings("decode", [*base, "--prefix-cache-states", "2"], environ={})
    assert (alone.prefix_cache_blocks, alone.prefix_cache_states) == (None, 2)
    for engine in ("hf", "paged"):
        for boundary in ("n-1", "full"):  # full: the key also names the first token's draw
            flags = ["--engine", engine, "--boundary", boundary, "--prefix-cache-blocks", "8", "--prefix-cache-states", "2"]
            ok = parse_settings("decode", [*base, *flags], environ={})
            assert (ok.prefix_cache_states, ok.boundary) == (2, boundary)


# The pool tests: a checkpoint's copies live in the engine's own blocks. With 16 blocks a 20-token
# prompt's checkpoint holds 3 (its one attention block and the two Mamba groups' blocks; no full
# block, so the prefix cache keeps nothing of it) and a 380-token prompt needs 14 (12 + 2).
SMALL, LONG = 20, 380


async def _generate_within(pair: RunningPair, prompt: list[int], request_id: str, timeout: float) -> Generated:
    """`pair.generate` with a short deadline: a request that waits for blocks fails soon."""
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=ANSWER, request_id=request_id)
    tokens: list[int] = []
    summary = pb.GenerateSummary()
    async for reply in pair.stub.Generate(request, timeout=timeout):
        if reply.HasField("chunk"):
            tokens.extend(reply.chunk.token_ids)
        else:
            summary = reply.summary
    return Generated(tokens, summary)


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_request_short_of_blocks_reclaims_an_unused_checkpoint(subject: Subject, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's blocks count in the pool; a request that needs them gets them at once
    (it would otherwise wait for frees that never come and fail RESOURCE_EXHAUSTED), and its
    own checkpoint, finding no free blocks, is simply not taken."""
    jobs = count_jobs(monkeypatch)
    small, long = random_tokens(12, SMALL), random_tokens(13, LONG)
    async with subject_pair(subject, 1, 1, num_blocks=16, extra_decode=_states()) as pair:
        host, reuse = pair.decode.host, pair.decode.servicer.generation.reuse
        first = await pair.generate(small, ANSWER, request_id="small")
        await _exact(subject, small, first)
        assert (len(reuse.states), reuse.states.num_blocks, reuse.prefix.num_blocks) == (1, 3, 0)
        assert host.allocator.num_used == 3 and _metric(pair, "hybrid_pd_blocks_in_use") == 3
        got = await _generate_within(pair, long, "long", timeout=10)
        await _exact(subject, long, got)
        assert len(reuse.states) == 0 and _metric(pair, "hybrid_pd_prefix_state_evictions_total") == 1
        again = await pair.generate(small, ANSWER, request_id="small-again")  # evicted: prefills again
        assert again.token_ids == first.token_ids
        _assert_read(again)
        assert jobs == ["small", "long", "small-again"]
        assert host.reclaim is not None
        host.reclaim(host.num_blocks)
        assert host.allocator.num_used == 0  # cleared: nothing leaks


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_a_checkpoint_being_restored_is_never_reclaimed(
    subject: Subject, inject_faults: Callable[[Injector], None]
) -> None:
    """While a request holds the checkpoint (paused after its restore), a request short of blocks
    waits rather than take it, and a checkpoint of another request is not taken meanwhile (the
    waiting request gets the next free blocks); once the holder ends, the waiting one reclaims it."""
    small, other, long = random_tokens(14, SMALL), random_tokens(15, SMALL), random_tokens(16, LONG)
    go = asyncio.Event()
    inject_faults(HoldAfterRead("holder", go))
    async with subject_pair(subject, 1, 1, num_blocks=16, extra_decode=_states()) as pair:
        host, states = pair.decode.host, pair.decode.servicer.generation.reuse.states
        first = await pair.generate(small, ANSWER, request_id="first")
        held = oldest_checkpoint(pair.decode)
        before = checkpoint_pages(pair.decode, held)
        holder = asyncio.ensure_future(pair.generate(small, ANSWER, request_id="holder"))
        while held.users == 0:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(_generate_within(pair, long, "long", timeout=60))
        while host.waiting_for_blocks == 0:
            await asyncio.sleep(0.01)
        meanwhile = await pair.generate(other, ANSWER, request_id="meanwhile")  # fits the free blocks
        await _exact(subject, other, meanwhile)
        assert list(states._entries.values()) == [held]  # not reclaimed, and no checkpoint taken
        now = checkpoint_pages(pair.decode, held)
        assert all(torch.equal(x, y) for rank, was in zip(now, before) for x, y in zip(rank, was))
        assert not waiting.done() and _metric(pair, "hybrid_pd_prefix_state_evictions_total") == 0
        go.set()
        reused = await holder
        assert reused.token_ids == first.token_ids
        _assert_restored(reused, subject.computed(SMALL))
        await _exact(subject, long, await waiting)
        assert len(states) == 0 and _metric(pair, "hybrid_pd_prefix_state_evictions_total") == 1
        assert host.reclaim is not None
        host.reclaim(host.num_blocks)
        assert host.allocator.num_used == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("subject", SUBJECTS, ids=IDS)
async def test_reclaim_takes_least_recently_used_checkpoints_then_prefix_blocks(subject: Subject) -> None:
    a, b = random_tokens(17, 70), random_tokens(18, SMALL)  # a: 2 prefix cache blocks and a 3-block checkpoint
    async with subject_pair(subject, 1, 1, extra_decode=_states()) as pair:
        host, reuse = pair.decode.host, pair.decode.servicer.generation.reuse
        for rid, prompt in (("a", a), ("b", b), ("a-again", a)):  # a used last: b's checkpoint is the oldest
            await pair.generate(prompt, ANSWER, request_id=rid)
        newest = reuse.states._entries[next(reversed(reuse.states._entries))]
        assert (len(reuse.states), reuse.prefix.num_blocks) == (2, 2)
        assert host.reclaim is not None
        assert host.reclaim(1) == 3  # a whole checkpoint goes: b's
        assert list(reuse.states._entries.values()) == [newest] and newest.computed == subject.computed(len(a))
        assert host.reclaim(4) == 3 + 1  # then a's, then one prefix block (a chain's tail first)
        assert len(reuse.states) == 0 and reuse.prefix.num_blocks == 1
        got = await pair.generate(a, ANSWER, request_id="a-head")
        await _exact(subject, a, got)
        assert got.summary.prefix_cached_tokens == pair.decode.host.layout.block_size  # the head stayed
        host.reclaim(host.num_blocks)
        assert host.allocator.num_used == 0
