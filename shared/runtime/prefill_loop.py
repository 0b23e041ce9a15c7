"""Batched prefill: one step loop per prefill engine computes the chunks of many jobs together.

Each step is ONE call on the engine's compute thread (`BatchedPrefill.prefill_batch`) in which
several jobs each compute their next chunk. A job's chunks are fixed by its prompt (multiples of
the engine's chunk size: shared/engine/prefill_chunks.py), never by the load, and the engine's
batch invariance makes a chunk's bits the same whoever shares its step: a prompt's state and
first token do not depend on what else was prefilled beside it.

Scheduling, within `max_batched_tokens` tokens a step:
- the oldest waiting chunk always runs (even when it alone is over the budget), so no job
  starves;
- then the other waiting chunks in the order their jobs arrived, each one that still fits;
- a job has at most one chunk in a step (its next chunk starts from this one's state), so a long
  prompt in chunks takes one chunk a step and the short prompts arriving meanwhile share its
  steps instead of queueing behind all of it.

A step's chunks come back first: the next batch is taken only once every job of the step just
ended has had its turn on the event loop (a job computing in chunks queues its next chunk in
that turn), so jobs that computed together keep computing together instead of alternating with
the chunks that queued meanwhile.

A chunk withdrawn before its step starts (its job was cancelled or failed) never runs; one
withdrawn during its step ends with that step, and only then may its blocks be freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from dataclasses import dataclass, field

from shared.engine.protocol import BatchedPrefill, PrefillChunk, PrefillRun
from shared.engine.timed import timed
from shared.observe import BATCH_SIZE, TOKENS, Observer, Stage
from shared.runtime.step_loop import Submit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkDone:
    """What a chunk's step gave it: the run's `compute` result (the first token at the end of a
    full-N prefill, else None), the step's engine seconds and how many chunks / tokens it had."""

    first_token: int | None
    step_seconds: float
    batch_size: int
    batch_tokens: int


@dataclass(eq=False)
class _Waiting:
    chunk: PrefillChunk
    tokens: int
    order: int  # the job's arrival: its first chunk's place in line
    done: asyncio.Future[ChunkDone] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    stepped: bool = False  # taken into a step: its job's turn after the step is awaited


class PrefillLoop:
    """The waiting chunks of one engine's jobs and the task stepping them."""

    def __init__(self, engine: BatchedPrefill, submit: Submit, max_batched_tokens: int) -> None:
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {max_batched_tokens}")
        self._engine = engine
        self._submit = submit  # queues a call on the engine's compute thread
        self.max_batched_tokens = max_batched_tokens
        self._waiting: list[_Waiting] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._arrivals = itertools.count()
        self._returning = 0  # jobs of the last step whose turn after it has not come yet
        self._back = asyncio.Event()
        self._back.set()
        self.steps = 0  # steps run (metrics, tests)
        self.largest_batch = 0
        self.in_step = 0  # chunks of the step on the compute thread now
        self.observer = Observer()  # each step's engine time (Stage.PREFILL_STEP)

    @property
    def waiting(self) -> int:
        """Chunks waiting for a step, not yet taken into one."""
        return len(self._waiting)

    def arrival(self) -> int:
        """A new job's place in line (its chunks keep it)."""
        return next(self._arrivals)

    async def compute(self, run: PrefillRun, start: int, end: int, order: int) -> ChunkDone:
        """Compute `run`'s tokens [start, end) in the next step that takes them. Cancelled while
        waiting, the chunk is withdrawn; cancelled during its step, this returns only once the
        step has ended (nothing writes the job's blocks any more), then raises CancelledError."""
        waiting = _Waiting(PrefillChunk(run, end), end - start, order)
        self._waiting.append(waiting)
        self._ensure_running()
        self._wake.set()
        try:
            return await asyncio.shield(waiting.done)
        except asyncio.CancelledError:
            if waiting in self._waiting:
                self._waiting.remove(waiting)
                waiting.done.cancel()
            else:
                with contextlib.suppress(BaseException):
                    await asyncio.shield(waiting.done)  # its step is running: let it end first
            raise
        finally:
            if waiting.stepped:  # after the caller's code up to its next await (its next chunk, if any)
                asyncio.get_running_loop().call_soon(self._came_back)

    def _came_back(self) -> None:
        self._returning -= 1
        if self._returning == 0:
            self._back.set()

    def next_batch(self) -> list[_Waiting]:
        """The chunks of the next step (see the module doc), taken out of the line."""
        line = sorted(self._waiting, key=lambda w: w.order)
        batch, tokens = [line[0]], line[0].tokens
        for waiting in line[1:]:
            if tokens + waiting.tokens <= self.max_batched_tokens:
                batch.append(waiting)
                tokens += waiting.tokens
        for waiting in batch:
            self._waiting.remove(waiting)
            waiting.stepped = True
        return batch

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="prefill-loop")

    async def _run(self) -> None:
        while True:
            await self._back.wait()
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self.next_batch()
            self.in_step = len(batch)
            self._returning = len(batch)  # every member's compute() ends once the step did
            self._back.clear()
            chunks = [w.chunk for w in batch]
            tokens = sum(w.tokens for w in batch)
            try:
                firsts, seconds = await self._submit(functools.partial(timed, self._engine.prefill_batch, chunks))
            except asyncio.CancelledError:
                for waiting in batch:
                    waiting.done.cancel()
                raise
            except Exception as exc:  # the batch's state writes cannot be told apart: it fails whole
                log.warning("a prefill step of %d chunks failed: %s", len(batch), exc)
                for waiting in batch:
                    if not waiting.done.done():
                        waiting.done.set_exception(exc)
                continue
            finally:
                self.in_step = 0
            self.steps += 1
            self.largest_batch = max(self.largest_batch, len(batch))
            if self.observer.listening():
                self.observer.stage(Stage.PREFILL_STEP, seconds, {BATCH_SIZE: len(batch), TOKENS: tokens})
            for waiting, first in zip(batch, firsts):
                if not waiting.done.done():
                    waiting.done.set_result(ChunkDone(first, seconds, len(batch), tokens))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for waiting in self._waiting:
            waiting.done.cancel()
        self._waiting.clear()
