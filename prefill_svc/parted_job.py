"""One job sent in manifest parts (pipelined transfer: --prefill-chunk-tokens, for a job that
accepts parts, on an engine that can continue a prefill: `ChunkedPrefill`).

The prompt is computed chunk by chunk and, as `part_plan.part_spans` says, a part leaves after
the chunks that made new attention blocks final, with the digests of just those tokens; the pin
is made before the first part (one READ notification expected per reader and part) and the last
part brings the conv / SSM state. With --layer-parts, for a job that accepts them, the last
span's state leaves in parts of consecutive layers as the engine reports them final
(prefill_svc/layer_parts.py).

The stages of each span: queue its compute (always one span ahead of the one awaited, so the
compute thread goes from chunk to chunk without waiting for the event loop), await it, take its
digests (on a host cache, parts but the last on the digest thread beside the next span's
chunks; a device cache needs them ordered after the span's kernels, on the compute thread), pin
(first part), send the part (the last is returned). From the first part on, the pin owns the
blocks: a job that fails later leaves them to decode's release, the cancel, or the lease; a job
that stops (its pin ended, it failed) computes no span not started yet, and its blocks are freed
only once the last span queued and every digest taken aside are done with them.

Where the engine batches (prefill's step loop: shared/runtime/prefill_loop.py), the chunks are
members of batched prefill steps beside other jobs' chunks, in the loop's order (the job's place
in line is its arrival), each chunk's bits those of the chunk alone. One task computes the
job's spans in order, every span queued at once: a chunk goes to the loop in the same event-loop
turn as the step of the chunk before it ends, so the job stays in the steps it shares with
others; the parts still leave in order as run() takes each span's result. A job that stops
withdraws a chunk still waiting for its step; one in a step ends with it, and only then are the
blocks freed. With layer parts the last chunk computes alone on the compute thread (between
steps): it reports each layer final through `on_layer`, which takes digests and raises once the
job stops, and in a batched step that would hold up, or fail, the other jobs' chunks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from prefill_svc.job import ComputedState, FirstLogprobs, Job, PartSink, TokenSink, deadline_passed, draws_more, manifest_of
from prefill_svc.layer_parts import Digests, LayerPartFeed
from prefill_svc.part_plan import PartSpan
from prefill_svc.pins import Pin, PinTable
from prefill_svc.resume import Resume
from shared import observe
from shared.cache.digest import Section, state_digests
from shared.cache.manifest import Manifest, ManifestPart
from shared.engine.first_logprobs import start_scoring
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import ChunkedPrefill, PrefillRun, RequestBlocks
from shared.errors import Aborted, DeadlineExceeded
from shared.observe import Step
from shared.runtime import faults
from shared.runtime.engine_host import EngineHost
from shared.runtime.prefill_loop import PrefillLoop


class PartedJob:
    def __init__(
        self,
        host: EngineHost,
        pins: PinTable,
        chunk_tokens: int,
        job: Job,
        tid: str,
        blocks: RequestBlocks,
        computed: int,
        spans: list[PartSpan],
        layers: list[range] | None,
        resume: Resume,
        steps: PrefillLoop | None = None,
    ) -> None:
        """`spans`: the job's parts (part_plan.part_spans, more than one); `layers`: the last
        span's layer parts (None: one last part of every layer); `resume`: where the compute
        starts (a kept boundary: spans before it compute nothing, their parts still leave) and
        the boundary the job keeps; `steps`: the engine's prefill loop, where it batches (None:
        each span is one call on the compute thread)."""
        self.resume = resume
        self.host, self.pins, self.chunk_tokens = host, pins, chunk_tokens
        self.job, self.tid, self.blocks, self.computed, self.spans, self.layers = job, tid, blocks, computed, spans, layers
        self.loop = asyncio.get_running_loop()
        engine = host.engine
        assert isinstance(engine, ChunkedPrefill)
        self.run_state = resume.start(engine, job, blocks)
        start_scoring(self.run_state, job.prompt_logprobs)
        self.pin: Pin | None = None
        self.digest_seconds = self.engine_seconds = 0.0
        self.engine_before = 0.0  # the engine seconds of the spans done (in order, on the compute thread)
        # Set once the job stops early (its pin ended, it failed or was cancelled, or a span
        # raised): a span queued ahead then computes nothing. Read on the compute thread.
        self.stop = threading.Event()
        self.aside = host.verify_transfer and host.device == "cpu"  # parts but the last: digests beside the compute
        self.reading: list[asyncio.Future[Digests]] = []  # parts' digests being taken aside
        self.feed: LayerPartFeed | None = None
        if layers is not None:
            last = spans[-1]
            self.feed = LayerPartFeed(
                job.request_id,
                layers,
                self.stop,
                functools.partial(self.digest_span, job, blocks, last, True),
                self.digest_aside(job, blocks, last, True) if self.aside else None,
            )
            self.feed.on_reading = self._cover
        # Token parts, then the last span's layer parts (one part of every layer without them).
        self.count = len(spans) - 1 + (1 if layers is None else len(layers))
        # A TEST-ONLY hold between parts keeps the next span from being queued until it is over.
        self.held = faults.holds("between_parts", job.request_id)
        self.queued: collections.deque[asyncio.Future[ComputedState]] = collections.deque()
        self.latest: asyncio.Future[ComputedState] | None = None  # the last span queued
        self.steps = steps
        self.order = 0 if steps is None else steps.arrival()  # the job's place in the loop's line
        # Batched: each span's result, the spans queued (their compute may start) and the task computing them.
        self.span_done = [self.loop.create_future() for _ in spans] if steps is not None else []
        self.go = [asyncio.Event() for _ in spans] if steps is not None else []
        self.computing: asyncio.Task[None] | None = None
        # Spans queued beyond the one awaited: on the compute thread one keeps it busy; in the
        # loop's steps every span (a chunk not waiting when a step starts misses that step).
        self.ahead = 1 if steps is None else len(spans)
        self.started = 0.0
        self.on_end: Callable[[str], None] | None = None
        self.on_part: PartSink = _no_part
        self.announce: TokenSink | None = None
        self.drawn = FirstLogprobs()

    async def run(
        self,
        started: float,
        on_end: Callable[[str], None] | None,
        on_part: PartSink,
        announce: TokenSink | None,
        drawn: FirstLogprobs,
    ) -> Manifest:
        """Every part but the last goes to `on_part` as soon as it is pinned; the last is
        returned. `on_end`: told the reason when the pin ends; `announce`: the first token;
        `drawn`: gets what the job asked for besides the state (logprobs, forks' first tokens)."""
        self.started, self.on_end, self.on_part, self.announce = started, on_end, on_part, announce
        self.drawn = drawn
        try:
            for ahead in range(1 if self.held else min(1 + self.ahead, len(self.spans))):
                self._queue(ahead)
            for index, span in enumerate(self.spans):
                last = index == len(self.spans) - 1
                compute = self.queued.popleft()
                if last and self.feed is not None:
                    await self._send_layer_parts(index, span, compute)
                state = await asyncio.shield(compute)
                observe.mark(Step.COMPUTED)
                if last and self.resume.pending is not None:
                    self.resume.cache.insert(self.resume.pending, self.blocks)
                if self.aside and not last:
                    state = await self._digests_aside(span, state)
                self.digest_seconds += state.digest_seconds
                self.engine_seconds += state.engine_seconds
                self._check_deadline()
                if self.pin is None:
                    self._pin()
                if last:
                    observe.mark(Step.MANIFEST_BUILT)
                    layers = None if self.feed is None else self.feed.ranges[-1]
                    return self._part(self.count - 1, span, state.digests, state.first_token, layers)
                part = self._part(index, span, state.digests, state.first_token, None)
                if not self.held and index + 1 + self.ahead < len(self.spans):
                    self._queue(index + 1 + self.ahead)
                self.on_part(part)
                await faults.pause("between_parts", self.job.request_id)
                await faults.part_left(self.job.request_id, index)
                if self.held:
                    self._queue(index + 1)
        except BaseException:
            self._abandon()
            raise
        raise AssertionError("unreachable: the last span returns")

    # --- the stages -----------------------------------------------------------------------
    def _queue(self, index: int) -> None:
        """Span `index`'s chunks and digests, queued on the compute thread now; the pin (from
        the first part on) frees the blocks only once the last span queued is done."""
        if self.stop.is_set():
            raise self._released()
        future = self._start_span(index)
        self.queued.append(future)
        self.latest = future
        if self.pin is not None:
            self.pin.writer = self._writing()

    def _start_span(self, index: int) -> asyncio.Future[ComputedState]:
        """Span `index`'s compute, started: in the prefill loop's steps where the engine batches
        (by the job's computing task, after the span before it), else one call on the compute
        thread (behind it)."""
        if self.steps is None:
            return self.host.submit_compute(functools.partial(self._span_work, index))
        self.go[index].set()
        if self.computing is None:
            self.computing = asyncio.ensure_future(self._compute_in_steps())
        return self.span_done[index]

    def _span_start(self, index: int) -> int:
        return max(self.resume.tokens, 0 if index == 0 else self.spans[index - 1].compute_to)

    def _span_work(self, index: int) -> ComputedState:
        """On the compute thread: the span's chunks and (unless taken aside) its digests."""
        if self.stop.is_set():
            raise self._released()
        start = self._span_start(index)
        last = index == len(self.spans) - 1
        try:
            done = self.compute_span(
                self.job,
                self.run_state,
                self.blocks,
                start,
                self.spans[index],
                last,
                self.engine_before,
                self.announce if last else None,
                last or not self.aside,
                self.drawn,
                self.feed if last else None,
            )
        except BaseException:
            self.stop.set()  # before the span queued behind this one starts on a broken run
            raise
        self.engine_before += done.engine_seconds
        return done

    async def _compute_in_steps(self) -> None:
        """The spans in order, each once queued, their results (or the error) to `span_done`;
        a span after one that failed or was cancelled never starts. Cancelled, this ends only
        once nothing it started writes or reads the blocks any more."""
        index = 0
        try:
            for index in range(len(self.spans)):
                await self.go[index].wait()
                if self.stop.is_set():
                    raise self._released()
                self.span_done[index].set_result(await self._stepped_span(index))
        except BaseException as exc:
            self.stop.set()  # the spans after this one never start on a broken run
            for k, later in enumerate(self.span_done[index:]):
                if isinstance(exc, asyncio.CancelledError) or k:
                    later.cancel()
                else:
                    later.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _stepped_span(self, index: int) -> ComputedState:
        assert self.steps is not None
        job, run, blocks, span = self.job, self.run_state, self.blocks, self.spans[index]
        last = index == len(self.spans) - 1
        start = self._span_start(index)
        ends = chunk_ends(start, span.compute_to, self.chunk_tokens)
        alone = last and self.feed is not None and bool(ends)  # layer parts: the last chunk alone (module doc)
        first_token, engine_seconds = None, 0.0
        for end in ends[:-1] if alone else ends:
            if self.stop.is_set():  # stopped between chunks: none after
                raise self._released()
            done = await self.steps.compute(run, start, end, self.order)
            first_token, start = done.first_token, end
            engine_seconds += done.step_seconds
            if self.resume.keeps_at(end):  # before the next chunk moves the run's state on
                await _done_with(self.host.submit_compute(functools.partial(self.resume.take, self.host.engine, run, blocks)))
        if alone:
            tail = await _done_with(
                self.host.submit_compute(functools.partial(self._last_chunk_alone, start, self.engine_before + engine_seconds))
            )
            self.engine_before += engine_seconds + tail.engine_seconds
            return ComputedState(tail.first_token, tail.digests, tail.digest_seconds, engine_seconds + tail.engine_seconds)
        self.engine_before += engine_seconds
        if last:
            if draws_more(job, first_token):  # on a compute thread, as colocated draws them
                await _done_with(self.host.digest_thread.submit(functools.partial(self.drawn.draw, run, first_token, job)))
            if self.announce is not None and first_token is not None:
                self.announce(first_token, self.engine_before, self.drawn.value)
        if (self.aside and not last) or not self.host.verify_transfer:
            return ComputedState(first_token, [], 0.0, engine_seconds)
        on = self.host.digest_thread.submit if self.host.device == "cpu" else self.host.submit_compute
        digests, took = await _done_with(on(functools.partial(self.digest_span, job, blocks, span, last)))
        return ComputedState(first_token, digests, took, engine_seconds)

    def _last_chunk_alone(self, start: int, engine_before: float) -> ComputedState:
        """On the compute thread: the last chunk of a job in layer parts, its layers reported to
        the feed, then the first token and the last range's digests (`compute_span`)."""
        if self.stop.is_set():
            raise self._released()
        last = self.spans[-1]
        return self.compute_span(
            self.job, self.run_state, self.blocks, start, last, True, engine_before, self.announce, True, self.drawn, self.feed
        )

    async def _send_layer_parts(self, index: int, span: PartSpan, compute: asyncio.Future[ComputedState]) -> None:
        """The last chunk's layer parts but the last, each as the engine made its layers final."""
        assert self.feed is not None
        for k in range(len(self.feed.ranges) - 1):
            _, (digests, _) = await self.feed.next(compute)  # beside the compute: not in digest_seconds
            if self.stop.is_set():  # released meanwhile: no more parts
                raise self._released()
            self._check_deadline()
            self.on_part(self._part(index + k, span, digests, None, self.feed.ranges[k]))

    async def _digests_aside(self, span: PartSpan, state: ComputedState) -> ComputedState:
        """A part's digests on the digest thread, beside the next span already queued on the
        compute thread; the blocks are freed only once both are done with them."""
        self.reading.append(self.digest_aside(self.job, self.blocks, span, False)(None))
        self._cover()
        digests, _ = await asyncio.shield(self.reading[-1])  # not on the compute path: not in digest_seconds
        return ComputedState(state.first_token, digests, state.digest_seconds, state.engine_seconds)

    def _pin(self) -> None:
        """Pinned before the first part leaves: every part's READs notify with the transfer id,
        one notification per reader and part."""
        readers = [n * self.count for n in self.job.readers_per_rank]
        self.pin = self.pins.pin(self.tid, self.job.request_id, self.job.owner, readers, on_end=self._ended)
        self.pin.writer = self._writing()

    def _part(self, index: int, span: PartSpan, digests: list[Any], first_token: int | None, layers: range | None) -> Manifest:
        assert self.pin is not None
        state = ComputedState(first_token, digests, self.digest_seconds, self.engine_seconds)
        part = ManifestPart(index, self.count, span.tokens_from, span.tokens_to, layers)
        return manifest_of(
            self.host.verify_transfer,
            self.job,
            self.tid,
            self.blocks,
            self.computed,
            self.pin,
            self.started,
            state,
            self.drawn,
            part,
        )

    def _abandon(self) -> None:
        """The job stopped: spans queued but never awaited have their outcome taken, not logged.
        Unpinned, the blocks are the job's to free once the compute and digest threads are done
        with them (the last span queued, the parts' digests); pinned, the pin frees them."""
        self.stop.set()
        if self.computing is not None:  # a chunk waiting for its step is withdrawn; one in a step ends with it
            self.computing.cancel()
        for ahead in self.queued:
            if ahead is not self.latest:
                ahead.add_done_callback(_take_outcome)
        if self.latest is not None:
            tid = None if self.pin is not None else self.tid
            self._writing().add_done_callback(functools.partial(_after_compute, self.host, tid))
        elif self.pin is None:
            self.host.free(self.tid)

    # --- the work on the compute and digest threads ----------------------------------------
    def digest_aside(
        self, job: Job, blocks: RequestBlocks, span: PartSpan, ends: bool
    ) -> Callable[[range | None], asyncio.Future[Digests]]:
        """Queues a part's digests on the digest thread (called on the loop): of `span`, of a
        layer range or of every layer (None)."""

        def submit(layers: range | None) -> asyncio.Future[Digests]:
            return self.host.digest_thread.submit(functools.partial(self.digest_span, job, blocks, span, ends, layers))

        return submit

    def compute_span(
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
    ) -> ComputedState:
        """On the compute thread: the chunks up to the span's end (the last chunk reporting its
        layers to `feed`, the last span's layer parts), then (`digest`) the part's digests
        (`digest_span`; with layer parts, of the last range). The first token (or None; the
        last span gives it to `announce` before the digests, with the engine seconds of every
        span, `engine_before` those before this one), the digests, and the seconds the digests
        on this thread and the engine took."""
        first_token = None
        on_layer = None if feed is None else feed.on_layer
        computing = time.monotonic()
        for end in chunk_ends(start, span.compute_to, self.chunk_tokens):
            first_token = run.compute(end, on_layer)  # called in the prompt's last chunk only
            if self.resume.keeps_at(end):  # before the next chunk moves the run's state on
                self.resume.take(self.host.engine, run, blocks)
        drawn.draw(run, first_token, job, prompt=last)
        aside_of_engine = 0.0 if feed is None else feed.digest_seconds  # layer parts' digests taken on this thread
        computing = time.monotonic() - computing - aside_of_engine
        if announce is not None and first_token is not None:
            announce(first_token, engine_before + computing, drawn.value)
        if not digest or not self.host.verify_transfer:
            return ComputedState(first_token, [], aside_of_engine, computing)
        digests, took = self.digest_span(job, blocks, span, last, None if feed is None else feed.ranges[-1])
        return ComputedState(first_token, digests, took + aside_of_engine, computing)

    def digest_span(self, job: Job, blocks: RequestBlocks, span: PartSpan, ends: bool, layers: range | None = None) -> Digests:
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
        faults.digested(self.host, blocks, job.request_id, span.tokens_from, last=ends, layers=layers)
        return digests, took

    # --- helpers ----------------------------------------------------------------------------
    def _ended(self, reason: str) -> None:
        self.stop.set()
        if self.on_end is not None:
            self.on_end(reason)

    def _writing(self) -> asyncio.Future[Any]:
        """Done once neither the compute thread (the last span queued; batched: the computing
        task) nor the digest thread uses the blocks any more."""
        assert self.latest is not None
        writer: asyncio.Future[Any] = self.latest if self.computing is None else self.computing
        more = [*self.reading, *(self.feed.reading if self.feed is not None else [])]
        return _all_done(writer, *more) if more else writer

    def _cover(self) -> None:
        """A part's digests went aside: the pin frees the blocks after them too."""
        if self.pin is not None:
            self.pin.writer = self._writing()

    def _check_deadline(self) -> None:
        if deadline_passed(self.job.deadline, self.loop.time()):
            raise DeadlineExceeded(
                f"the job's deadline passed during prefill ({time.monotonic() - self.started:.3f}s)", field="job.timeout"
            )

    def _released(self) -> Aborted:
        return Aborted(f"request {self.job.request_id} was released during its prefill", reason="RELEASED")


def _after_compute(host: EngineHost, tid: str | None, future: asyncio.Future[object]) -> None:
    """The last span a stopped job queued is done: free the blocks (`tid`; None: the pin does),
    and take its outcome, which nobody awaits any more."""
    _take_outcome(future)
    if tid is not None:
        host.free(tid)


async def _done_with(future: asyncio.Future[Any]) -> Any:
    """`future`'s outcome; cancelled meanwhile, this waits for it to be done first (the thread
    or step behind it uses the job's blocks until then), then raises CancelledError."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if not future.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(future)
        raise


def _all_done(*futures: asyncio.Future[Any]) -> asyncio.Future[Any]:
    """Done once every one of `futures` is, whatever their outcomes (taken)."""
    return asyncio.gather(*futures, return_exceptions=True)


def _take_outcome(future: asyncio.Future[Any]) -> None:
    """Retrieve a result nobody awaits, so asyncio does not log its exception as lost."""
    if not future.cancelled():
        future.exception()


def _no_part(part: Manifest) -> None:
    raise AssertionError("a part before run() was given its sink")
