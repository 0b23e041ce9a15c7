"""Jobs in manifest parts share batched prefill steps (pipelined transfer on the paged engine):
several requests with long prompts run at once through a real pair (tiny checkpoints loaded
from disk, real NIXL READs, prefill TP 1 -> decode TP 2), prefill cuts each prompt into chunks
of 16 tokens and sends a part after every chunk that made attention blocks final, and the
chunks of different jobs compute in the same prefill steps. Every request's tokens equal the
same request computed alone by the colocated runner with the same chunks, bit for bit, and
decode's --check-state recomputes every prompt alone (in prefill's chunks, learnt at the
handshake) and finds the READ state equal.

A part left unread in decode's blocks changes that request's tokens (negative control: the
comparison can fail), and a request cancelled while one of its chunks is in a step keeps its
blocks until the step ends, computes no chunk after it, and leaves the others' tokens exact."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest

from decode_svc.app import DecodeApp
from decode_svc.request_options import sampling_from
from prefill_svc.parted_job import PartedJob
from shared.engine.logprobs import TokenLogprobs
from shared.engine.paged.engine import PagedEngine, PagedPrefillRun
from shared.engine.protocol import PrefillChunk
from shared.engine.sampling import SamplingParams
from shared.engine.stopping import StopRule
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.rpc.logprobs_message import logprobs_of
from shared.runtime.colocated import Colocated
from shared.runtime.faults import Injector
from tests.integration.exactness.pair import drop_part_reads
from tests.integration.exactness.test_paged_under_load import alone
from tests.integration.services.hf_services import generate_with, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

FAMILY = "nemotron_h"  # prefill blocks of 48 tokens at TP 1: a part every third chunk
CHUNK = 16
# Four chunks a step: the jobs' chunks share steps (the last of a prompt may be shorter).
PREFILL_FLAGS = ("--prefill-chunk-tokens", str(CHUNK), "--max-batched-tokens", str(4 * CHUNK), "--num-blocks", "256")
DECODE_FLAGS = ("--num-blocks", "256")  # decode accepts parts by default
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=91)

Request = tuple[list[int], int, SamplingParams | None]


def load(vocab: int, count: int) -> list[Request]:
    """(prompt, max_tokens, sampling) of each request: prompts of 100..170 tokens (3 or 4 parts), every other seeded."""
    out: list[Request] = []
    for i in range(count):
        prompt = [(17 * i + 5 * j) % (vocab - 4) + 4 for j in range(100 + (i * 23) % 71)]
        out.append((prompt, 5 + i % 4, SEEDED if i % 2 else None))
    return out


def fields(request: Request, request_id: str) -> dict[str, Any]:
    prompt, max_tokens, sampling = request
    f: dict[str, Any] = {"request_id": request_id, "prompt_token_ids": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if sampling is not None:
        f["sampling"] = dpb.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed
        )
    return f


async def together(decode: DecodeApp, requests: Sequence[Request]) -> list[tuple[list[int], dpb.GenerateSummary]]:
    return list(await asyncio.gather(*(generate_with(decode.port, **fields(r, f"r{i}")) for i, r in enumerate(requests))))


def parts_read(decode: DecodeApp, summary: dpb.GenerateSummary) -> int:
    """The manifest parts a request's READs came in (one READ per prefill rank a part)."""
    pairs = len(decode.peers.peers[0].link.pairs)  # type: ignore[union-attr]
    return summary.transfer.read_count // pairs


async def test_jobs_in_parts_share_prefill_steps_and_equal_each_alone(hf_checkpoint: Callable[[str], str]) -> None:
    """Then a second wave extending every prompt: each job resumes at the chunk boundary prefill
    kept of its first turn (prefix reuse on prefill), its parts before it computing nothing."""
    directory = hf_checkpoint(FAMILY)
    async with hf_pair(directory, directory, 1, 2, engine="paged", prefill_flags=PREFILL_FLAGS, decode_flags=DECODE_FLAGS) as (
        prefill,
        decode,
    ):
        vocab = decode.host.spec.vocab_size
        first = load(vocab, 6)
        second = [([*p, *[(t * 7) % (vocab - 4) + 4 for t in range(30)]], n, s) for p, n, s in first]
        got = await together(decode, first)
        hits = prefill.metrics.registry.get_sample_value("hybrid_pd_prefill_boundary_hits_total") or 0.0
        got += await together(decode, second)
        resumed = (prefill.metrics.registry.get_sample_value("hybrid_pd_prefill_boundary_hits_total") or 0.0) - hits
        steps = prefill.servicer.runner.steps
        assert steps is not None and steps.largest_batch >= 2, "no prefill step had two jobs' chunks"
        parts = [parts_read(decode, summary) for _, summary in got]
    assert min(parts) >= 3, parts  # every request came in manifest parts
    assert resumed == len(second)
    for _, summary in got:
        assert summary.state_verified and summary.digests_verified
    requests = [*first, *second]
    want = await alone(directory, requests, prefill_chunk_tokens=CHUNK)
    for i, ((ids, _), w) in enumerate(zip(got, want)):
        assert ids == w, f"request {i}: in parts under load {ids}, alone {w}"


async def test_negative_control_a_part_left_unread_changes_that_requests_tokens(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TEST-ONLY: decode drops the READ of request r1's first part (digests off, no --check-state,
    so nothing else notices): its tokens must differ from its run alone, the others' not."""
    drop_part_reads(monkeypatch, lambda part: part.request_id == "r1" and part.part is not None and part.part.index == 0)
    off = ("--verify-transfer", "off")
    directory = hf_checkpoint(FAMILY)
    async with hf_pair(
        directory,
        directory,
        1,
        2,
        engine="paged",
        check_state=False,
        prefill_flags=(*PREFILL_FLAGS, *off),
        decode_flags=(*DECODE_FLAGS, *off),
    ) as (_, decode):
        requests = load(decode.host.spec.vocab_size, 4)
        got = await together(decode, requests)
    want = await alone(directory, requests, prefill_chunk_tokens=CHUNK)
    assert got[1][0] != want[1], "a part left unread changed no token: the exactness check cannot fail"
    assert [g for i, (g, _) in enumerate(got) if i != 1] == [w for i, w in enumerate(want) if i != 1]


class PartLeft(Injector):
    """TEST-ONLY: tells when a request's first part left prefill (nothing is held)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.left = threading.Event()

    async def part_left(self, request_id: str, index: int) -> None:
        if request_id == self.request_id:
            self.left.set()


class StepGate:
    """TEST-ONLY: holds the first prefill step with a chunk `holds` picks, on the compute
    thread, before it computes, until `go` is set (at most 60 s)."""

    def __init__(
        self, inner: Callable[[Sequence[PrefillChunk]], list[int | None]], holds: Callable[[PrefillChunk], bool]
    ) -> None:
        self.inner, self.holds = inner, holds
        self.held_at = -1  # the prompt tokens the held chunk's run had computed
        self.in_step, self.go = threading.Event(), threading.Event()

    def prefill_batch(self, chunks: Sequence[PrefillChunk]) -> list[int | None]:
        picked = [c.run for c in chunks if self.holds(c)]
        if picked and not self.in_step.is_set():
            run = picked[0]
            assert isinstance(run, PagedPrefillRun)
            self.held_at = run.computed
            self.in_step.set()
            self.go.wait(60)
        return self.inner(chunks)


def parted_jobs(monkeypatch: pytest.MonkeyPatch) -> dict[str, PartedJob]:
    """Every job prefill runs in parts, by request id, as it is made."""
    made: dict[str, PartedJob] = {}
    init = PartedJob.__init__

    def recording(self: PartedJob, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made[self.job.request_id] = self

    monkeypatch.setattr(PartedJob, "__init__", recording)
    return made


async def polled(check: Callable[[], bool]) -> bool:
    """Whether `check` comes true, polled a while (never timed)."""
    for _ in range(3000):
        if check():
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_job_cancelled_in_its_parts_keeps_its_blocks_until_its_step_ends(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, inject_faults: Callable[[Injector], None]
) -> None:
    """A long request's chunk is held in its prefill step (TEST-ONLY gate on the compute thread)
    after its first part left; the client goes away and decode releases it. Prefill keeps its
    blocks while the step runs, computes none of its chunks after it, and frees everything once
    the step ended; the requests computing beside it equal their runs alone."""
    made = parted_jobs(monkeypatch)
    first_part = PartLeft("victim")
    inject_faults(first_part)
    directory = hf_checkpoint(FAMILY)
    async with hf_pair(directory, directory, 1, 2, engine="paged", prefill_flags=PREFILL_FLAGS, decode_flags=DECODE_FLAGS) as (
        prefill,
        decode,
    ):
        engine = prefill.host.engine
        assert isinstance(engine, PagedEngine)

        def victims(chunk: PrefillChunk) -> bool:
            job = made.get("victim")
            return job is not None and chunk.run is job.run_state and first_part.left.is_set()

        gate = StepGate(engine.prefill_batch, victims)
        monkeypatch.setattr(engine, "prefill_batch", gate.prefill_batch)
        vocab = decode.host.spec.vocab_size
        requests = load(vocab, 3)
        victim: Request = ([(11 * j) % (vocab - 4) + 4 for j in range(230)], 8, None)
        others = [asyncio.ensure_future(generate_with(decode.port, **fields(r, f"r{i}"))) for i, r in enumerate(requests)]
        call = asyncio.ensure_future(generate_with(decode.port, **fields(victim, "victim")))
        try:
            assert await polled(gate.in_step.is_set), "the victim's chunk never reached a step after its first part"
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            released = await polled(lambda: prefill.pins.ended.get("released") == 1)
            held_during_step = prefill.host.allocator.held(made["victim"].tid)
        finally:
            gate.go.set()
        got = await asyncio.gather(*others)
        kept = prefill.servicer.runner.boundaries  # the boundaries prefill keeps hold their own blocks
        freed = await polled(
            lambda: (
                prefill.host.allocator.num_used == kept.num_blocks and not (decode.host.allocator.num_used or len(prefill.pins))
            )
        )
        held_after = prefill.host.allocator.held(made["victim"].tid)
        run = made["victim"].run_state
        assert isinstance(run, PagedPrefillRun)
        computed = run.computed
    assert released and held_during_step > 0 and freed and held_after == 0, (released, held_during_step, freed, held_after)
    assert gate.held_at >= CHUNK and computed == gate.held_at + CHUNK, (gate.held_at, computed)  # no chunk after the step
    want = await alone(directory, requests, prefill_chunk_tokens=CHUNK)
    for i, ((ids, summary), w) in enumerate(zip(got, want)):
        assert ids == w, f"request {i}: beside the cancelled job {ids}, alone {w}"
        assert summary.state_verified and summary.digests_verified


Streams = dict[int, tuple[list[int], list[TokenLogprobs]]]


async def generate_streams(port: int, n: int = 1, **fields: Any) -> tuple[Streams, list[TokenLogprobs] | None]:
    """Each sequence's tokens and logprobs, and the prompt's logprobs (None: none came)."""
    streams: Streams = {i: ([], []) for i in range(n)}
    prompt: list[TokenLogprobs] | None = None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = dpb.GenerateRequest(n=n, ignore_eos=True, **fields)
        async for reply in dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=60):
            if reply.HasField("prompt_logprobs"):
                prompt = [logprobs_of(lp) for lp in reply.prompt_logprobs.tokens]
            if reply.HasField("chunk"):
                ids, lps = streams[reply.chunk.index]
                ids += reply.chunk.token_ids
                lps += [logprobs_of(lp) for lp in reply.chunk.logprobs]
    return streams, prompt


async def colocated_streams(
    directory: str, runs: Sequence[tuple[list[int], int, SamplingParams, int, int | None]]
) -> list[tuple[list[int], list[TokenLogprobs], list[TokenLogprobs] | None]]:
    """Each (prompt, max_tokens, sampling, logprobs, prompt_logprobs) alone through the colocated
    runner with prefill's chunks: tokens, their logprobs, the prompt's."""
    colocated = await asyncio.to_thread(Colocated.build, "paged", directory, 1, 512, prefill_chunk_tokens=CHUNK)
    out = []
    try:
        for prompt, max_tokens, sampling, k, prompt_k in runs:
            stream = colocated.stream(
                "c", prompt, max_tokens, sampling=sampling, stop=StopRule(max_tokens), logprobs=k, prompt_logprobs=prompt_k
            )
            got = [t async for t in stream]
            lps = [t.logprobs for t in got if t.logprobs is not None]
            out.append(([t.token_id for t in got], lps, None if prompt_k is None else list(got[0].prompt_logprobs or [])))
    finally:
        colocated.close()
    return out


async def test_logprobs_prompt_logprobs_and_forks_in_parts_equal_each_alone(hf_checkpoint: Callable[[str], str]) -> None:
    """What a job draws besides the state, in parts beside other jobs: the first token's
    logprobs, the prompt's logprobs (every chunk's rows) and the forks' first tokens (n = 2,
    seed + i), each equal to its request alone, bit for bit."""
    directory = hf_checkpoint(FAMILY)
    seed, max_tokens = 1234, 5
    seeded = dpb.SamplingParams(temperature=0.8, top_k=50, seed=seed)
    async with hf_pair(directory, directory, 1, 2, engine="paged", prefill_flags=PREFILL_FLAGS, decode_flags=DECODE_FLAGS) as (
        prefill,
        decode,
    ):
        (echoed, _, _), (forked, _, _), (other, _, _) = load(decode.host.spec.vocab_size, 3)
        common: dict[str, Any] = {"max_tokens": max_tokens}
        (a, a_prompt), (b, _), (c, _) = await asyncio.gather(
            generate_streams(decode.port, prompt_token_ids=echoed, logprobs=2, prompt_logprobs=2, **common),
            generate_streams(decode.port, 2, prompt_token_ids=forked, logprobs=1, sampling=seeded, **common),
            generate_streams(decode.port, prompt_token_ids=other, logprobs=1, sampling=seeded, **common),
        )
        steps = prefill.servicer.runner.steps
        assert steps is not None and steps.largest_batch >= 2, "no prefill step had two jobs' chunks"

    def with_seed(s: int) -> SamplingParams:
        return sampling_from(dpb.SamplingParams(temperature=0.8, top_k=50, seed=s))

    want = await colocated_streams(
        directory,
        [
            (echoed, max_tokens, SamplingParams(), 2, 2),
            (forked, max_tokens, with_seed(seed), 1, None),
            (forked, max_tokens, with_seed(seed + 1), 1, None),
            (other, max_tokens, with_seed(seed), 1, None),
        ],
    )
    assert a_prompt is not None and len(a_prompt) == len(echoed) - 1
    assert (a[0][0], a[0][1], a_prompt) == want[0]
    assert b[0] == want[1][:2] and b[1] == want[2][:2]
    assert b[0][0] != b[1][0]  # the forks' seeds gave different sequences: the comparison can tell them apart
    assert c[0] == want[3][:2]
