"""One prefill job: validate, allocate blocks on every rank, run the engine off the loop, take
the state's digests, pin, and describe the result in a manifest.

Pipelined transfer (--prefill-chunk-tokens, for a job that accepts manifest parts, on an engine
that can continue a prefill: `ChunkedPrefill`): the prompt is computed chunk by chunk and, as
`part_plan.part_spans` says, a part leaves after the chunks that made new attention blocks
final, with the digests of just those tokens; the pin is made before the first part (one READ
notification expected per reader and part) and the last part brings the conv / SSM state.
One span's chunks are always queued on the compute thread ahead of the span the event loop
awaits, so the thread goes from chunk to chunk without waiting for the loop; on a host cache, a
part's digests (but the last's) are taken on the host's digest thread, beside the next span's
chunks, not before them (a device cache needs a copy ordered after the span's kernels: there
the compute thread takes them). With --layer-parts, for a job that accepts them, the last
span's state leaves in parts of consecutive layers as the engine reports them final
(prefill_svc/layer_parts.py). From the first
part on, the pin owns the blocks: a job that fails later leaves them to decode's release, the
cancel, or the lease; a job that stops (its pin ended, it failed) computes no span not started
yet, and its blocks are freed only once the last span queued is done.

Decode's prefix cache (`cached_prompt_tokens`): the whole prompt is still computed (the SSM
state needs it), but no digest covers the K/V of the cached tokens, and every manifest echoes
the count; with parts, the first part starts there (the parts cover only the tokens after the
cached prefix)."""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from prefill_svc.layer_parts import Digests, LayerPartFeed
from prefill_svc.part_plan import PartSpan, part_spans
from prefill_svc.pins import Pin, PinTable
from shared import limits, tracing
from shared.cache.digest import DIGEST_ALGORITHM, Section, SectionDigest, state_digests
from shared.cache.manifest import Manifest, ManifestPart
from shared.engine.first_logprobs import fork_draws, prefill_with_logprobs, run_logprobs, scored_prompt, start_scoring
from shared.engine.logprobs import TokenLogprobs
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import ChunkedPrefill, PrefillRun, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams, leaves_a_token
from shared.errors import Aborted, DeadlineExceeded, FieldIssue, InvalidArgument
from shared.layout.spec import layer_ranges
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.rpc import fault_hooks
from shared.rpc.deadlines import wait_deadline
from shared.rpc.proto_time import seconds
from shared.rpc.sampling_message import sampling_of_job
from shared.rpc.token_ids import token_list
from shared.runtime.engine_host import EngineHost
from shared.tracing import Step


@dataclass(frozen=True)
class Job:
    """One job of a Session, as the session hands it to `JobRunner.run`."""

    request_id: str
    prompt: list[int]
    deadline: float | None  # event-loop time; None: the job has no deadline
    owner: str  # the decode incarnation whose pin this becomes
    readers_per_rank: list[int]  # decode ranks that READ from each prefill rank
    sampling: SamplingParams = GREEDY  # draws the first output token at the full-N boundary
    accepts_parts: bool = False  # decode takes the state in manifest parts (pipelined transfer)
    cached_tokens: int = 0  # leading prompt tokens whose K/V decode holds: not digested (nor READ)
    wants_first_token: bool = False  # full-N: the first token goes out the moment it is drawn
    accepts_layer_parts: bool = False  # with parts: the last chunk's state may come in layer parts
    logprobs: int | None = None  # full-N: the first token's logprobs with the k likeliest (None: none)
    prompt_logprobs: int | None = None  # the prompt's logprobs with the k likeliest (None: none)
    fork_seeds: tuple[int, ...] = ()  # full-N: output token 0 drawn again with each (several sequences)


def job_from_message(job: pb.PrefillJob, *, owner: str, readers_per_rank: list[int], now: float) -> Job:
    """The job once as domain values; `now` is event-loop time (the timeout travels as a duration)."""
    deadline = now + seconds(job.timeout) if job.HasField("timeout") else None
    return Job(
        job.request_id,
        token_list(job.prompt_token_ids),
        deadline,
        owner,
        readers_per_rank,
        sampling_of_job(job),
        job.accept_manifest_parts,
        job.cached_prompt_tokens,
        job.accept_first_token,
        job.accept_layer_parts,
        job_count(job, "logprobs"),
        job_count(job, "prompt_logprobs"),
        tuple(job.fork_seeds),
    )


def job_count(job: pb.PrefillJob, name: Literal["logprobs", "prompt_logprobs"]) -> int | None:
    """A job's top-logprobs count (None: unset)."""
    if not job.HasField(name):
        return None
    return limits.LOGPROBS.check(getattr(job, name), f"job.{name}")


@dataclass
class FirstLogprobs:
    """The logprobs a job asked for, set on the compute thread: the first token's as it is drawn
    (full-N), the prompt's once the last chunk is computed."""

    value: TokenLogprobs | None = None
    prompt: tuple[TokenLogprobs, ...] | None = None
    forks: tuple[int, ...] = ()  # output token 0 drawn with each fork seed
    fork_logprobs: tuple[TokenLogprobs, ...] = ()


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


PartSink = Callable[[Manifest], None]
"""Takes each manifest part but the last (which `JobRunner.run` returns), in order."""

TokenSink = Callable[[int, float, TokenLogprobs | None], None]
"""Takes the first output token of a job that asked for it, with the engine's seconds computing
the prompt and its logprobs (when the job asked), on the event loop, the moment the compute thread drew it: before the digests, the
pin and the manifest."""


class JobRunner:
    def __init__(
        self, host: EngineHost, pins: PinTable, chunk_tokens: int = 0, part_tokens: int = 0, layer_parts: int = 0
    ) -> None:
        self.host = host
        self.pins = pins
        self.chunk_tokens = chunk_tokens  # --prefill-chunk-tokens (0: off)
        self.part_tokens = part_tokens  # --manifest-part-tokens (0: a part per chunk)
        self.layer_parts = layer_parts  # --layer-parts (0: the last part covers every layer)
        self._ids = itertools.count(1)
        # TEST-ONLY: awaited after each manifest part but the last left, with the request id and
        # the part's index, before the next chunk computes (tests hold prefill there).
        self.after_part: Callable[[str, int], Awaitable[None]] | None = None

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

    async def allocate(self, key: str, num_tokens: int, deadline: float | None) -> RequestBlocks:
        """Blocks for the job; while the cache is full, wait for frees (queued) until shortly
        before the job's deadline, then RESOURCE_EXHAUSTED. Without a deadline: no waiting."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        return await self.host.allocate_queued(key, num_tokens, now if deadline is None else wait_deadline(deadline, now))

    async def run(
        self,
        job: Job,
        *,
        on_end: Callable[[str], None] | None = None,
        on_part: PartSink | None = None,
        on_first_token: TokenSink | None = None,
    ) -> Manifest:
        """The job's manifest; with parts (see the module doc) every part but the last goes to
        `on_part` as soon as it is pinned, and the last is returned. At the full-N boundary, a
        job that asked for it has its first token given to `on_first_token` as soon as it is drawn."""
        tracing.mark(Step.JOB_STARTED)
        prompt, deadline = job.prompt, job.deadline
        validate_prompt(self.host, job.request_id, prompt)
        check_sampling(job.sampling, self.host.spec.vocab_size)
        engine = self.host.engine
        computed = engine.num_prefill_tokens(len(prompt))
        check_cached_tokens(job.cached_tokens, computed)
        tid = self.next_transfer_id()
        blocks = await self.allocate(tid, computed, deadline)
        started = time.monotonic()
        spans = self.spans_for(job, computed, on_part)
        announce = _announcer(job, on_first_token)
        drawn = FirstLogprobs()
        if len(spans) > 1:
            assert on_part is not None
            return await self._run_parts(job, tid, blocks, computed, spans, started, on_end, on_part, announce, drawn)
        # Queued now as the compute thread's own future: no task around it to schedule and resume.
        compute = self.host.submit_compute(lambda: self._compute(job, blocks, computed, announce, drawn))
        try:
            first_token, digests, digest_seconds, engine_seconds = await asyncio.shield(compute)
            tracing.mark(Step.COMPUTED)
        except asyncio.CancelledError:
            # The engine may still be writing these blocks: free them only once it is done.
            compute.add_done_callback(lambda _: self.host.free(tid))
            raise
        except BaseException:
            self.host.free(tid)
            raise
        try:
            await fault_hooks.pause("before_manifest", job.request_id)
            injected = fault_hooks.failure_for(job.request_id)
            if injected is not None:
                raise injected
        except BaseException:
            self.host.free(tid)
            raise
        elapsed = time.monotonic() - started
        loop = asyncio.get_running_loop()
        if deadline is not None and loop.time() >= deadline:
            self.host.free(tid)
            raise DeadlineExceeded(f"the job's deadline passed during prefill ({elapsed:.3f}s)", field="job.timeout")
        # Expectations are registered before the manifest leaves: no notification can beat them.
        pin = self.pins.pin(tid, job.request_id, job.owner, job.readers_per_rank, on_end=on_end)
        lease_ns = max(0, int((pin.lease_deadline - loop.time()) * 1e9))
        tracing.mark(Step.MANIFEST_BUILT)
        return Manifest(
            request_id=job.request_id,
            transfer_id=tid,
            block_ids=tuple(blocks.block_ids),
            num_computed_tokens=computed,
            prompt_token_count=len(prompt),
            lease_ns=lease_ns,
            lease_expire_time_ns=time.time_ns() + lease_ns,
            prefill_ns=int(elapsed * 1e9),
            digests=tuple(digests),
            digest_algorithm=DIGEST_ALGORITHM if self.host.verify_transfer else "",
            digest_ns=int(digest_seconds * 1e9),
            first_token=first_token,
            skipped_tokens=job.cached_tokens,
            engine_ns=int(engine_seconds * 1e9),
            first_logprobs=drawn.value,
            prompt_logprobs=drawn.prompt,
            fork_first_tokens=drawn.forks,
            fork_first_logprobs=drawn.fork_logprobs,
        )

    async def _run_parts(
        self,
        job: Job,
        tid: str,
        blocks: RequestBlocks,
        computed: int,
        spans: list[PartSpan],
        started: float,
        on_end: Callable[[str], None] | None,
        on_part: PartSink,
        announce: TokenSink | None,
        drawn: FirstLogprobs,
    ) -> Manifest:
        loop = asyncio.get_running_loop()
        engine = self.host.engine
        assert isinstance(engine, ChunkedPrefill)
        run = engine.start_prefill(job.prompt, blocks, job.sampling)
        start_scoring(run, job.prompt_logprobs)
        pin: Pin | None = None
        digest_seconds = engine_seconds = 0.0
        # Set once the job stops early (its pin ended, it failed or was cancelled, or a span
        # raised): a span queued ahead then computes nothing. Read on the compute thread.
        stop = threading.Event()

        def ended(reason: str) -> None:
            stop.set()
            if on_end is not None:
                on_end(reason)

        engine_before = 0.0  # the engine seconds of the spans done (spans run in order, all on the compute thread)
        aside = self.host.verify_transfer and self.host.device == "cpu"  # parts but the last: digests beside the compute
        reading: list[asyncio.Future[Digests]] = []  # parts' digests being taken aside
        last_span = spans[-1]
        layers = self.last_layers_for(job, spans)
        feed: LayerPartFeed | None = None
        if layers is not None:
            feed = LayerPartFeed(
                job.request_id,
                layers,
                stop,
                functools.partial(self._digest_span, job, blocks, last_span, True),
                self._digest_aside(job, blocks, last_span, True) if aside else None,
            )
        # Token parts, then the last span's layer parts (one part of every layer without them).
        count = len(spans) - 1 + (1 if layers is None else len(layers))

        def span_work(index: int) -> tuple[int | None, list[SectionDigest], float, float]:
            nonlocal engine_before
            if stop.is_set():
                raise Aborted(f"request {job.request_id} was released during its prefill", reason="RELEASED")
            start = 0 if index == 0 else spans[index - 1].compute_to
            try:
                last = index == len(spans) - 1
                digest = last or not aside
                done = self._compute_span(
                    job,
                    run,
                    blocks,
                    start,
                    spans[index],
                    last,
                    engine_before,
                    announce if last else None,
                    digest,
                    drawn,
                    feed if last else None,
                )
                engine_before += done[3]
                return done
            except BaseException:
                stop.set()  # before the span queued behind this one starts on a broken run
                raise

        def writing(last_queued: asyncio.Future[Any]) -> asyncio.Future[Any]:
            """Done once neither the compute thread (`last_queued`: the last span queued) nor the
            digest thread uses the blocks any more."""
            more = [*reading, *(feed.reading if feed is not None else [])]
            return _all_done(last_queued, *more) if more else last_queued

        def queue(index: int) -> asyncio.Future[tuple[int | None, list[SectionDigest], float, float]]:
            """Span `index`'s chunks and digests, queued on the compute thread now; the pin (from
            the first part on) frees the blocks only once the last span queued is done."""
            if stop.is_set():
                raise Aborted(f"request {job.request_id} was released during its prefill", reason="RELEASED")
            future = self.host.submit_compute(functools.partial(span_work, index))
            if pin is not None:
                pin.writer = writing(future)
            return future

        def cover() -> None:  # a layer part's digests went aside: the pin frees the blocks after them too
            if pin is not None:
                pin.writer = writing(latest)

        if feed is not None:
            feed.on_reading = cover

        def part_of(
            index: int, span: PartSpan, digests: list[SectionDigest], first_token: int | None, layers: range | None
        ) -> Manifest:
            assert pin is not None
            lease_ns = max(0, int((pin.lease_deadline - loop.time()) * 1e9))
            return Manifest(
                request_id=job.request_id,
                transfer_id=tid,
                block_ids=tuple(blocks.block_ids),
                num_computed_tokens=computed,
                prompt_token_count=len(job.prompt),
                lease_ns=lease_ns,
                lease_expire_time_ns=time.time_ns() + lease_ns,
                prefill_ns=int((time.monotonic() - started) * 1e9),
                digests=tuple(digests),
                digest_algorithm=DIGEST_ALGORITHM if self.host.verify_transfer else "",
                digest_ns=int(digest_seconds * 1e9),
                first_token=first_token,
                part=ManifestPart(index, count, span.tokens_from, span.tokens_to, layers),
                skipped_tokens=job.cached_tokens,
                engine_ns=int(engine_seconds * 1e9),
                first_logprobs=drawn.value if first_token is not None else None,
                prompt_logprobs=drawn.prompt if index == count - 1 else None,
                fork_first_tokens=drawn.forks if first_token is not None else (),
                fork_first_logprobs=drawn.fork_logprobs if first_token is not None else (),
            )

        def check_deadline() -> None:
            if deadline_passed(job.deadline, loop.time()):
                raise DeadlineExceeded(
                    f"the job's deadline passed during prefill ({time.monotonic() - started:.3f}s)", field="job.timeout"
                )

        # One span is always queued ahead of the one the loop awaits, so the compute thread goes
        # from span to span without waiting for the event loop. A TEST-ONLY hold between parts
        # instead keeps the next span from being queued until the hold is over.
        held = self.after_part is not None or fault_hooks.pauses_at("between_parts", job.request_id)
        queued = collections.deque([queue(0)])
        if not held and len(spans) > 1:
            queued.append(queue(1))
        latest = queued[-1]
        try:
            for index, span in enumerate(spans):
                last = index == len(spans) - 1
                compute = queued.popleft()
                if last and feed is not None:
                    # The last chunk's layer parts, each as the engine made its layers final.
                    for k in range(len(feed.ranges) - 1):
                        _, (digests, _) = await feed.next(compute)  # beside the compute: not in digest_seconds
                        if stop.is_set():  # released meanwhile: no more parts
                            raise Aborted(f"request {job.request_id} was released during its prefill", reason="RELEASED")
                        check_deadline()
                        on_part(part_of(index + k, span, digests, None, feed.ranges[k]))
                first_token, digests, took, computing = await asyncio.shield(compute)
                tracing.mark(Step.COMPUTED)
                if aside and not last:
                    # Beside the next span, already queued on the compute thread; the blocks
                    # are freed only once both are done with them.
                    reading.append(self._digest_aside(job, blocks, span, False)(None))
                    cover()
                    digests, _ = await asyncio.shield(reading[-1])  # not on the compute path: not in digest_seconds
                digest_seconds += took
                engine_seconds += computing
                check_deadline()
                if pin is None:
                    # Every part's READs notify with the transfer id: one notification per reader and part.
                    readers = [n * count for n in job.readers_per_rank]
                    pin = self.pins.pin(tid, job.request_id, job.owner, readers, on_end=ended)
                    pin.writer = writing(latest)
                if last:
                    tracing.mark(Step.MANIFEST_BUILT)
                    return part_of(count - 1, span, digests, first_token, None if feed is None else feed.ranges[-1])
                part = part_of(index, span, digests, first_token, None)
                if not held and index + 2 < len(spans):
                    latest = queue(index + 2)
                    queued.append(latest)
                on_part(part)
                await fault_hooks.pause("between_parts", job.request_id)
                if self.after_part is not None:
                    await self.after_part(job.request_id, index)
                if held:
                    latest = queue(index + 1)
                    queued.append(latest)
        except BaseException:
            stop.set()
            for ahead in queued:  # spans queued but never awaited: their outcome is taken, not logged
                if ahead is not latest:
                    ahead.add_done_callback(_take_outcome)
            # Unpinned, the blocks are the job's to free, once the compute and digest threads are
            # done with them (the last span queued, the parts' digests); pinned, the pin frees them when it ends.
            writing(latest).add_done_callback(functools.partial(_after_compute, self.host, None if pin is not None else tid))
            raise
        raise AssertionError("unreachable: the last span returns")

    def _digest_aside(
        self, job: Job, blocks: RequestBlocks, span: PartSpan, ends: bool
    ) -> Callable[[range | None], asyncio.Future[Digests]]:
        """Queues a part's digests on the digest thread (called on the loop): of `span`, of a
        layer range or of every layer (None)."""

        def submit(layers: range | None) -> asyncio.Future[Digests]:
            return self.host.digest_thread.submit(functools.partial(self._digest_span, job, blocks, span, ends, layers))

        return submit

    def _compute_span(
        self,
        job: Job,
        run: PrefillRun,
        blocks: RequestBlocks,
        start: int,
        span: PartSpan,
        last: bool,
        engine_before: float,
        announce: TokenSink | None,
        digest: bool,
        drawn: FirstLogprobs,
        feed: LayerPartFeed | None = None,
    ) -> tuple[int | None, list[SectionDigest], float, float]:
        """On the compute thread: the chunks up to the span's end (the last chunk reporting its
        layers to `feed`, the last span's layer parts), then (`digest`) the part's digests
        (`_digest_span`; with layer parts, of the last range). Returns the first token (or None;
        the last span gives it to `announce` before the digests, with the engine seconds of every
        span, `engine_before` those before this one), the digests, and the seconds the digests
        on this thread and the engine took."""
        first_token = None
        on_layer = None if feed is None else feed.on_layer
        computing = time.monotonic()
        for end in chunk_ends(start, span.compute_to, self.chunk_tokens):
            first_token = run.compute(end, on_layer)  # called in the prompt's last chunk only
        drawn.value = run_logprobs(run, first_token, job.logprobs)
        drawn.forks, drawn.fork_logprobs = fork_draws(run, first_token, job.sampling, job.fork_seeds, job.logprobs)
        if last:
            drawn.prompt = scored_prompt(run, job.prompt_logprobs)
        aside_of_engine = 0.0 if feed is None else feed.digest_seconds  # layer parts' digests taken on this thread
        computing = time.monotonic() - computing - aside_of_engine
        if announce is not None and first_token is not None:
            announce(first_token, engine_before + computing, drawn.value)
        if not digest or not self.host.verify_transfer:
            return first_token, [], aside_of_engine, computing
        digests, took = self._digest_span(job, blocks, span, last, None if feed is None else feed.ranges[-1])
        return first_token, digests, took + aside_of_engine, computing

    def _digest_span(self, job: Job, blocks: RequestBlocks, span: PartSpan, ends: bool, layers: range | None = None) -> Digests:
        """The digests of what the part makes final (its tokens' K/V; a part that ends the prompt
        also conv and SSM; a layer part of its layers only), and the seconds they took; nothing
        later writes those bytes, so any thread may take them."""
        began = time.monotonic()
        if not self.host.verify_transfer:
            return [], 0.0
        sections: tuple[Section, ...] = ("fa", "conv", "ssm") if ends else ("fa",)
        digests = state_digests(
            self.host.layout,
            self.host.views,
            blocks.block_ids,
            span.tokens_to,
            tokens_from=span.tokens_from,
            sections=sections,
            layers=layers,
        )
        took = time.monotonic() - began
        section = fault_hooks.corruption_for(job.request_id)
        if (
            section is not None
            and (ends or section == "fa")
            and (layers is None or _corrupted_layer(self.host, section) in layers)
        ):
            _flip_one_byte(self.host, blocks, section, span.tokens_from)
        return digests, took

    def _compute(
        self, job: Job, blocks: RequestBlocks, computed: int, announce: TokenSink | None, drawn: FirstLogprobs
    ) -> tuple[int | None, list[SectionDigest], float, float]:
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
            return first_token, [], 0.0, computing
        started = time.monotonic()
        digests = state_digests(self.host.layout, self.host.views, blocks.block_ids, computed, tokens_from=job.cached_tokens)
        took = time.monotonic() - started
        section = fault_hooks.corruption_for(job.request_id)
        if section is not None:  # fa: in the first token decode READs (the cached K/V is not)
            _flip_one_byte(self.host, blocks, section, min(job.cached_tokens, max(0, computed - 1)))
        return first_token, digests, took, computing


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


def deadline_passed(deadline: float | None, now: float) -> bool:
    return deadline is not None and now >= deadline


def _after_compute(host: EngineHost, tid: str | None, future: asyncio.Future[object]) -> None:
    """The last span a stopped job queued is done: free the blocks (`tid`; None: the pin does),
    and take its outcome, which nobody awaits any more."""
    _take_outcome(future)
    if tid is not None:
        host.free(tid)


def _all_done(*futures: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """Done once every one of `futures` is, whatever their outcomes (taken)."""
    return asyncio.gather(*futures, return_exceptions=True)


def _take_outcome(future: asyncio.Future[Any]) -> None:
    """Retrieve a result nobody awaits, so asyncio does not log its exception as lost."""
    if not future.cancelled():
        future.exception()


def _corrupted_layer(host: EngineHost, section: str) -> int:
    """TEST-ONLY: the model layer whose byte `_flip_one_byte` flips for `section`."""
    kind = "attention" if section == "fa" else "mamba"
    return next(grp.layers[0] for grp in host.layout.groups if grp.kind == kind)


def _flip_one_byte(host: EngineHost, blocks: RequestBlocks, section: str, first_token: int = 0) -> None:
    """TEST-ONLY (HYBRID_PD_TEST_CORRUPT): flip the first byte of `section` that rank 0 holds for
    this request in the first group of its kind (fa: of token `first_token`, the first of a
    part), after the digests were taken."""
    layout, views = host.layout, host.views[0]
    kind = "attention" if section == "fa" else "mamba"
    group = next(g for g, grp in enumerate(layout.groups) if grp.kind == kind)
    ids = np.asarray(blocks.block_ids[group])
    if section == "fa":
        kernel, slot = layout.token_slots(ids, [first_token])
        target: torch.Tensor = views.fa[0][int(kernel[0]), 0, 0, int(slot[0])]
    else:
        target = (views.conv if section == "conv" else views.ssm)[0][int(ids[0])].reshape(-1)
    raw = target.view(torch.uint8)
    raw[0] = raw[0] ^ 0x01
