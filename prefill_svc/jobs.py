"""The prefill job path: admit (validate), blocks, compute (in batched prefill steps on an
engine that batches: shared/runtime/prefill_loop.py; else on the compute thread) with the
state's digests, the fault seam's `before_manifest`, pin, and the manifest describing it. A job
sent in manifest parts (pipelined transfer) runs prefill_svc/parted_job.py instead (its chunks
in the same steps).

Decode's prefix cache (`cached_prompt_tokens`): prefill still computes the prompt (the SSM
state needs it; from token 0, or from a boundary it kept itself: below), but no digest covers
the K/V of the cached tokens, and every manifest echoes the count; with parts, the first part
starts there (the parts cover only the tokens after the cached prefix).

Prefill's own prefix reuse (prefill_svc/boundary_cache.py, on engines that resume a chunked
prefill exactly): a job starts at the longest chunk boundary of its prompt the boundary cache
holds (its K/V blocks shared as the job's leading blocks, the conv / SSM state copied into the
job's blocks) and computes only the chunks after it; it keeps its own last boundary for the
next turn. Digests, parts, pins and the manifest are what a job from token 0 gives: the blocks
hold the same bytes. A job asking for prompt logprobs computes from token 0 (every chunk's logits)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np

from prefill_svc.boundary_cache import BoundaryCache, Pending
from prefill_svc.job import ComputedState, FirstLogprobs, Job, PartSink, TokenSink, deadline_passed, draws_more, manifest_of
from prefill_svc.layer_parts import Digests
from prefill_svc.part_plan import PartSpan, part_spans
from prefill_svc.parted_job import PartedJob
from prefill_svc.pins import PinTable
from prefill_svc.resume import Resume
from shared import observe
from shared.cache.digest import state_digests
from shared.cache.manifest import Manifest
from shared.config import DEFAULT_MAX_BATCHED_TOKENS
from shared.engine.first_logprobs import prefill_with_logprobs, start_scoring
from shared.engine.logprobs import TokenLogprobs
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import BatchedPrefill, ChunkedPrefill, RequestBlocks
from shared.engine.sampling import SamplingParams, leaves_a_token
from shared.errors import DeadlineExceeded, FieldIssue, InvalidArgument
from shared.layout.spec import layer_ranges
from shared.observe import Observer, Step
from shared.rpc.deadlines import wait_deadline
from shared.runtime import faults
from shared.runtime.engine_host import EngineHost
from shared.runtime.prefill_loop import PrefillLoop


def validate_prompt(host: EngineHost, request_id: str, prompt: Sequence[int]) -> None:
    """Reject a job that could never run, naming the field (nothing is touched)."""
    if not request_id:
        raise InvalidArgument("must be non-empty", field="job.request_id")
    if not prompt:
        raise InvalidArgument("the prompt is empty", field="job.prompt_token_ids")
    host.check_token_ids(prompt, "job.prompt_token_ids")
    needed = sum(host.blocks_per_group(host.engine.num_prefill_tokens(len(prompt))))
    if needed > host.num_blocks:
        raise InvalidArgument(
            f"a prompt of {len(prompt)} tokens needs {needed} blocks; this prefill engine has {host.num_blocks}",
            field="job.prompt_token_ids",
        )


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    """The ids min_tokens masks are tokens of the vocabulary, and leave one to draw."""
    field = "job.sampling.stop_token_ids"
    outside = sorted(t for t in sampling.stop_token_ids if t >= vocab_size)
    if outside:
        raise InvalidArgument(f"token ids must be < {vocab_size} (the vocabulary), got {outside[:4]}", field=field)
    if not leaves_a_token(sampling, vocab_size):
        raise InvalidArgument(
            f"they cover the whole vocabulary ({vocab_size} ids): no token is left to draw before min_tokens "
            f"({sampling.min_tokens})",
            field=field,
            issues=[FieldIssue("job.sampling.min_tokens", f"{sampling.min_tokens}, but the masked ids cover the vocabulary")],
        )


def check_cached_tokens(cached: int, computed: int) -> None:
    """Decode can hold at most the K/V prefill computes."""
    if cached > computed:
        raise InvalidArgument(
            f"{cached} cached prompt tokens, but this prefill engine computes {computed} of the prompt",
            field="job.cached_prompt_tokens",
        )


class JobRunner:
    def __init__(
        self,
        host: EngineHost,
        pins: PinTable,
        chunk_tokens: int = 0,
        part_tokens: int = 0,
        layer_parts: int = 0,
        max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
        boundary_blocks: int = 0,
        observer: Observer | None = None,
    ) -> None:
        self.host = host
        self.pins = pins
        self.chunk_tokens = chunk_tokens  # --prefill-chunk-tokens (0: off)
        self.part_tokens = part_tokens  # --manifest-part-tokens (0: a part per chunk)
        self.layer_parts = layer_parts  # --layer-parts (0: the last part covers every layer)
        self._ids = itertools.count(1)
        engine = host.engine
        # Batched prefill (shared/runtime/prefill_loop.py) for engines whose runs compute together.
        self.steps: PrefillLoop | None = None
        if isinstance(engine, BatchedPrefill) and isinstance(engine, ChunkedPrefill):
            self.steps = PrefillLoop(engine, host.submit_compute, max_batched_tokens)
        # Prefix reuse on prefill (--prefix-cache-blocks): only where jobs compute in steps.
        self.boundaries = BoundaryCache(host, boundary_blocks if self.steps is not None else 0, chunk_tokens, observer)
        if self.boundaries.enabled:
            host.reclaim = self.boundaries.reclaim  # a job short of blocks takes unused boundaries back

    async def aclose(self) -> None:
        if self.steps is not None:
            await self.steps.aclose()

    def spans_for(self, job: Job, computed: int, on_part: PartSink | None) -> list[PartSpan]:
        """The job's parts; one span (no parts) unless the job, the engine and the flag allow them."""
        engine, layout = self.host.engine, self.host.layout
        # The flag first: with it off (the default) no job pays for a runtime Protocol isinstance, a slow one.
        if on_part is None or not job.accepts_parts or self.chunk_tokens <= 0 or not offers_chunks(engine, self.chunk_tokens):
            return [PartSpan(computed, job.cached_tokens, computed)]
        block_tokens = layout.block_size if layout.attention_group_ids else 0
        return part_spans(computed, self.chunk_tokens, block_tokens, tokens_from=job.cached_tokens, part_tokens=self.part_tokens)

    def last_layers_for(self, job: Job, spans: list[PartSpan]) -> list[range] | None:
        """The layer ranges of the last span's parts; None (one last part of every layer) unless
        the job comes in parts and accepts layer parts, and --layer-parts asks for several."""
        if len(spans) < 2 or self.layer_parts < 2 or not job.accepts_layer_parts:
            return None
        num_layers = self.host.spec.num_layers
        return layer_ranges(num_layers, min(self.layer_parts, num_layers))

    def next_transfer_id(self) -> str:
        return f"t{next(self._ids):x}"

    async def allocate(
        self, key: str, num_tokens: int, deadline: float | None, leading: list[np.ndarray] | None = None
    ) -> RequestBlocks:
        """Blocks for the job (`leading`: a kept boundary's blocks, put first); while the cache
        is full, wait for frees (queued) until shortly before the job's deadline, then
        RESOURCE_EXHAUSTED. Without a deadline: no waiting."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        until = now if deadline is None else wait_deadline(deadline, now)
        return await self.host.allocate_queued(key, num_tokens, until, leading=leading)

    async def resume_point(self, job: Job, tid: str, computed: int) -> tuple[RequestBlocks, int, Pending | None]:
        """The job's blocks, the token its compute starts at (a kept boundary's, restored into
        its blocks; else 0) and the boundary it will keep (None: none)."""
        cache = self.boundaries
        if not cache.enabled or faults.corrupts(job.request_id):
            return await self.allocate(tid, computed, job.deadline), 0, None
        hit = None if job.prompt_logprobs is not None else cache.lookup(job.prompt, computed)
        try:
            blocks = await self.allocate(tid, computed, job.deadline, cache.leading(hit))
        except BaseException:
            if hit is not None:
                cache.release(hit)
            raise
        if hit is not None:
            self.host.when_freed(tid, functools.partial(cache.release, hit))
        pending = cache.plan(job.prompt, computed, hit)
        if pending is not None:
            self.host.when_freed(tid, functools.partial(cache.abandon, pending))
        if hit is None:
            return blocks, 0, pending
        restoring = self.host.submit_compute(functools.partial(cache.restore, hit, blocks))
        try:
            await asyncio.shield(restoring)
        except BaseException:
            # The copy may still be writing the job's blocks: free them once it is done.
            restoring.add_done_callback(lambda _: self.host.free(tid))
            raise
        return blocks, hit.tokens, pending

    def kept(self, pending: Pending | None, blocks: RequestBlocks) -> None:
        """The job computed its state: keep its boundary (taken during the compute)."""
        if pending is not None:
            self.boundaries.insert(pending, blocks)

    async def run(
        self,
        job: Job,
        *,
        on_end: Callable[[str], None] | None = None,
        on_part: PartSink | None = None,
        on_first_token: TokenSink | None = None,
    ) -> Manifest:
        """The job's manifest; with parts (prefill_svc/parted_job.py) every part but the last
        goes to `on_part` as soon as it is pinned, and the last is returned. At the full-N
        boundary, a job that asked for it has its first token given to `on_first_token` as soon
        as it is drawn. The stages: admit, blocks, compute (with the digests), the fault seam's
        before_manifest, pin, manifest; a failure before the pin frees the blocks."""
        observe.mark(Step.JOB_STARTED)
        computed = self.admit(job)
        tid = self.next_transfer_id()
        blocks, start, pending = await self.resume_point(job, tid, computed)
        started = time.monotonic()
        spans = self.spans_for(job, computed, on_part)
        announce = _announcer(job, on_first_token)
        drawn = FirstLogprobs()  # what the job asked for besides the state
        if len(spans) > 1:
            assert on_part is not None
            parted = PartedJob(
                self.host,
                self.pins,
                self.chunk_tokens,
                job,
                tid,
                blocks,
                computed,
                spans,
                self.last_layers_for(job, spans),
                Resume(self.boundaries, start, pending),
                self.steps,
            )
            return await parted.run(started, on_end, on_part, announce, drawn)
        state = await self._compute_whole(job, tid, blocks, computed, announce, drawn, Resume(self.boundaries, start, pending))
        self.kept(pending, blocks)
        try:
            await faults.pause("before_manifest", job.request_id)
            injected = faults.failure(job.request_id)
            if injected is not None:
                raise injected
            if deadline_passed(job.deadline, asyncio.get_running_loop().time()):
                raise DeadlineExceeded(
                    f"the job's deadline passed during prefill ({time.monotonic() - started:.3f}s)", field="job.timeout"
                )
        except BaseException:
            self.host.free(tid)
            raise
        # Expectations are registered before the manifest leaves: no notification can beat them.
        pin = self.pins.pin(tid, job.request_id, job.owner, job.readers_per_rank, on_end=on_end)
        observe.mark(Step.MANIFEST_BUILT)
        return manifest_of(self.host.verify_transfer, job, tid, blocks, computed, pin, started, state, drawn)

    def admit(self, job: Job) -> int:
        """Check the job (nothing is touched for one that fails); the prompt tokens it computes."""
        validate_prompt(self.host, job.request_id, job.prompt)
        check_sampling(job.sampling, self.host.spec.vocab_size)
        computed = self.host.engine.num_prefill_tokens(len(job.prompt))
        check_cached_tokens(job.cached_tokens, computed)
        return computed

    async def _compute_whole(
        self,
        job: Job,
        tid: str,
        blocks: RequestBlocks,
        computed: int,
        announce: TokenSink | None,
        drawn: FirstLogprobs,
        resume: Resume,
    ) -> ComputedState:
        """The whole prompt's state and digests: in prefill steps beside other jobs where the
        engine batches, else one call on the compute thread. Failed or cancelled, the blocks are
        freed once nothing writes them any more."""
        stepped = self.steps is not None and computed > 0
        if stepped:
            compute: asyncio.Future[ComputedState] = asyncio.ensure_future(
                self._compute_in_steps(job, blocks, computed, announce, drawn, resume)
            )
        else:
            # Queued now as the compute thread's own future: no task around it to schedule and resume.
            compute = self.host.submit_compute(lambda: self._compute(job, blocks, computed, announce, drawn))
        try:
            state = await asyncio.shield(compute)
        except asyncio.CancelledError:
            if stepped:
                compute.cancel()  # a chunk not in a step yet is withdrawn; one in a step ends with it
            # The engine may still be writing these blocks: free them only once it is done.
            compute.add_done_callback(lambda _: self.host.free(tid))
            raise
        except BaseException:
            self.host.free(tid)
            raise
        observe.mark(Step.COMPUTED)
        return state

    async def _compute_in_steps(
        self, job: Job, blocks: RequestBlocks, computed: int, announce: TokenSink | None, drawn: FirstLogprobs, resume: Resume
    ) -> ComputedState:
        """`_compute`, the engine's part in prefill steps beside other jobs' chunks (the engine's
        own chunks, so the bits are its `prefill`'s); the digests follow on the digest thread
        (a device cache: on the compute thread, ordered after the steps' kernels). The engine
        seconds are those of the steps the job was in."""
        assert self.steps is not None
        engine = self.host.engine
        assert isinstance(engine, ChunkedPrefill)
        run = resume.start(engine, job, blocks)
        start_scoring(run, job.prompt_logprobs)
        order = self.steps.arrival()
        first_token, engine_seconds, start = None, 0.0, resume.tokens
        for end in chunk_ends(start, computed, engine.exact_chunk_tokens or 0):
            done = await self.steps.compute(run, start, end, order)
            first_token, start = done.first_token, end
            engine_seconds += done.step_seconds
            if resume.keeps_at(end):  # before the next chunk moves the run's state on
                taking = self.host.submit_compute(functools.partial(resume.take, engine, run, blocks))
                try:
                    await asyncio.shield(taking)
                except asyncio.CancelledError:
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(taking)  # it writes the copies' blocks until it is done
                    raise
        if draws_more(job, first_token):  # on a compute thread, as colocated draws them
            await self.host.digest_thread.submit(functools.partial(drawn.draw, run, first_token, job))
        if announce is not None and first_token is not None:
            announce(first_token, engine_seconds, drawn.value)
        if not self.host.verify_transfer:
            return ComputedState(first_token, [], 0.0, engine_seconds)
        on = self.host.digest_thread.submit if self.host.device == "cpu" else self.host.submit_compute
        digesting = on(functools.partial(self._prompt_digests, job, blocks, computed))
        try:
            digests, took = await asyncio.shield(digesting)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await asyncio.shield(digesting)  # the digest thread reads the blocks until it is done
            raise
        return ComputedState(first_token, digests, took, engine_seconds)

    def _prompt_digests(self, job: Job, blocks: RequestBlocks, computed: int) -> Digests:
        """The digests of the whole computed prompt (but decode's cached prefix) and their seconds."""
        started = time.monotonic()
        digests = state_digests(self.host.layout, self.host.views, blocks.block_ids, computed, tokens_from=job.cached_tokens)
        took = time.monotonic() - started
        # fa: in the first token decode READs (the cached K/V is not)
        faults.digested(self.host, blocks, job.request_id, min(job.cached_tokens, max(0, computed - 1)))
        return digests, took

    def _compute(
        self, job: Job, blocks: RequestBlocks, computed: int, announce: TokenSink | None, drawn: FirstLogprobs
    ) -> ComputedState:
        """On the compute thread: the engine writes the state (and at the full-N boundary samples
        the first token, given to `announce` at once), then its digests are taken (returned with
        the seconds they and the engine took)."""
        computing = time.monotonic()
        done = prefill_with_logprobs(
            self.host.engine, job.prompt, blocks, job.sampling, job.logprobs, job.prompt_logprobs, job.fork_seeds
        )
        first_token, drawn.value, drawn.prompt = done.first, done.first_logprobs, done.prompt_logprobs
        drawn.forks, drawn.fork_logprobs = done.forks, done.fork_logprobs
        computing = time.monotonic() - computing
        if announce is not None and first_token is not None:
            announce(first_token, computing, drawn.value)
        if not self.host.verify_transfer:
            return ComputedState(first_token, [], 0.0, computing)
        digests, took = self._prompt_digests(job, blocks, computed)
        return ComputedState(first_token, digests, took, computing)


def _announcer(job: Job, on_first_token: TokenSink | None) -> TokenSink | None:
    """What the compute thread calls with the first token: `on_first_token` on the event loop,
    for a job that asked for the token early (None: nobody to tell)."""
    if on_first_token is None or not job.wants_first_token:
        return None
    sink, loop = on_first_token, asyncio.get_running_loop()

    def announce(token: int, engine_seconds: float, logprobs: TokenLogprobs | None) -> None:
        loop.call_soon_threadsafe(sink, token, engine_seconds, logprobs)

    return announce


def offers_chunks(engine: object, chunk_tokens: int) -> bool:
    """Whether the engine computes a prefill in chunks of `chunk_tokens` with its own prefill's bits."""
    return isinstance(engine, ChunkedPrefill) and engine.exact_chunk_tokens in (None, chunk_tokens)
