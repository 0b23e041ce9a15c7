"""Continuous batching: one step loop per decode engine owns the running requests.

Each step is ONE call on the engine's compute thread in which every running request computes
its next token: an engine that batches (`BatchedDecode`, the paged engine) steps them all in one
forward; any other engine steps each session in turn inside the same call. A request joins at
the next step once its state sits in its blocks (`join`), and leaves when its stop rule ends it,
its deadline passes, its consumer goes away or its step fails, without disturbing the others.
Each token reaches its request's stream the moment the step that computed it ends.

Blocks: before a step every member's blocks must hold one more token (`Room`). A member the
full cache cannot grow sits the steps out while the others go on, until blocks are freed or its
deadline passes (RESOURCE_EXHAUSTED): no member is preempted, none loses blocks it holds.

What a request computes never depends on who shares its step: the engine's batch invariance
(shared/engine/protocol.py `BatchedDecode`) makes that so for batched forwards, and sessions
stepped in turn touch only their own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from shared.engine.logprobs import TokenLogprobs, session_logprobs
from shared.engine.protocol import BatchedDecode, DecodeSession, Engine
from shared.engine.stopping import FinishReason, StopRule
from shared.errors import DeadlineExceeded
from shared.observe import BATCH_SIZE, Observer, Stage

log = logging.getLogger(__name__)
T = TypeVar("T")
StepResults = tuple[list[int | BaseException], list[TokenLogprobs | None], float]


class Submit(Protocol):
    """Queues a call on the engine's compute thread (`ComputeThread.submit`)."""

    def __call__(self, fn: Callable[[], T]) -> asyncio.Future[T]: ...


class Room(Protocol):
    """A member's blocks, grown one step ahead (decode_svc/growing_blocks.py)."""

    def try_room(self, steps: int) -> bool:
        """Whether the next `steps` steps fit now, growing the blocks without waiting."""
        ...

    def room_for(self, steps: int, deadline: float) -> Awaitable[int]:
        """Wait (on the loop) until at least one more step fits, or fail RESOURCE_EXHAUSTED."""
        ...


class AlwaysRoom:
    """Blocks allocated up front for the whole generation (the colocated baseline)."""

    def try_room(self, steps: int) -> bool:
        return True

    async def room_for(self, steps: int, deadline: float) -> int:
        return steps


@dataclass(frozen=True)
class Token:
    """One step's result for one member: its token, why it ended the request (None: it goes
    on) and the engine seconds of the step that computed it (shared by the whole batch)."""

    token_id: int
    finish: FinishReason | None
    step_seconds: float
    batch_size: int
    logprobs: TokenLogprobs | None = None  # when the member asked for them


@dataclass(eq=False)
class Member:
    """One running request in the loop."""

    session: DecodeSession
    stop: StopRule
    deadline: float  # event-loop time
    room: Room
    generated: int  # tokens the request has before its first step here
    logprobs: int | None = None  # None: no logprobs; k: each token's and the k likeliest
    _tokens: asyncio.Queue[Token | BaseException] = field(init=False, default_factory=asyncio.Queue)
    _growing: asyncio.Future[int] | None = field(init=False, default=None)  # waiting for blocks: sits the steps out
    last_step: asyncio.Future[Any] | None = field(init=False, default=None)  # the last step that included it
    done: bool = field(init=False, default=False)

    def _deliver(self, item: Token | BaseException) -> None:
        self._tokens.put_nowait(item)

    async def tokens(self) -> AsyncIterator[Token]:
        """This member's tokens, one per step, until one ends the request; a failure raises."""
        while True:
            item = await self._tokens.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish is not None:
                return


class StepLoop:
    """The running requests of one engine and the task stepping them."""

    def __init__(self, engine: Engine, submit: Submit) -> None:
        self._engine = engine
        self._batches = isinstance(engine, BatchedDecode)
        self._submit = submit  # queues a call on the engine's compute thread
        self._members: list[Member] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0  # steps run (metrics, tests)
        self.largest_batch = 0
        self.observer = Observer()  # each step's engine time (Stage.DECODE_STEP)

    @property
    def running(self) -> int:
        return len(self._members)

    def join(
        self,
        session: DecodeSession,
        stop: StopRule,
        deadline: float,
        room: Room,
        *,
        generated: int = 0,
        logprobs: int | None = None,
    ) -> Member:
        """Add a request whose state sits in its blocks; it takes part from the next step.
        `logprobs`: each token comes with its logprobs and the k likeliest (None: without)."""
        member = Member(session, stop, deadline, room, generated, logprobs)
        self._members.append(member)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="decode-step-loop")
        return member

    def leave(self, member: Member) -> None:
        """The request no longer wants tokens (finished, failed, or its consumer went away). A
        step already running with it still runs to its end: `member.last_step` says when."""
        member.done = True
        with contextlib.suppress(ValueError):
            self._members.remove(member)
        if member._growing is not None and not member._growing.done():
            member._growing.cancel()

    def _ready(self) -> list[Member]:
        """Members that take part in the next step; the others fail their deadline or wait for blocks."""
        now = asyncio.get_running_loop().time()
        ready: list[Member] = []
        for m in list(self._members):
            if m._growing is not None:
                if not m._growing.done():
                    continue
                growing, m._growing = m._growing, None
                error = None if growing.cancelled() else growing.exception()
                if error is not None:
                    self._fail(m, error)
                    continue
            if now > m.deadline:
                self._fail(m, DeadlineExceeded(f"deadline passed after {m.generated} of {m.stop.max_tokens} tokens"))
                continue
            if m.room.try_room(1):
                ready.append(m)
                continue
            m._growing = asyncio.ensure_future(m.room.room_for(1, m.deadline))
            m._growing.add_done_callback(lambda _: self._wake.set())
        return ready

    def _fail(self, member: Member, error: BaseException) -> None:
        self.leave(member)
        member._deliver(error)

    async def _run(self) -> None:
        while self._members:
            self._wake.clear()
            ready = self._ready()
            if not ready:
                await self._wake.wait()  # a join, or a member's blocks grown
                continue
            sessions = [m.session for m in ready]
            tops = [m.logprobs for m in ready]
            step = self._submit(functools.partial(_step, self._engine, sessions, tops, batched=self._batches))
            for m in ready:
                m.last_step = step
            try:
                results, logprobs, seconds = await asyncio.shield(step)
            except BaseException as e:  # the compute thread is shut down (service stopping)
                for m in ready:
                    self._fail(m, e)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            self.steps += 1
            self.largest_batch = max(self.largest_batch, len(ready))
            if self.observer.listening():
                self.observer.stage(Stage.DECODE_STEP, seconds, {BATCH_SIZE: len(ready)})
            for m, result, lp in zip(ready, results, logprobs):
                if m.done:  # left while the step ran: its token is nobody's
                    continue
                if isinstance(result, BaseException):
                    self._fail(m, result)
                    continue
                m.generated += 1
                finish = m.stop.finish(result, m.generated)
                if finish is not None:
                    self.leave(m)
                m._deliver(Token(result, finish, seconds, len(ready), lp))

    async def aclose(self) -> None:
        """Stop stepping (service shutdown): every member left fails with CancelledError."""
        task, self._task = self._task, None
        for m in list(self._members):
            self._fail(m, asyncio.CancelledError())
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _step(engine: Engine, sessions: Sequence[DecodeSession], tops: Sequence[int | None], *, batched: bool) -> StepResults:
    """One step of every session, on the compute thread: one batched forward where the engine
    batches (a failure then fails the whole batch: the forward's state writes are not
    attributable), else each session in turn (a failure fails that session only). With each
    token, its logprobs where `tops` asks (from the logits the session drew it from)."""
    began = time.monotonic()
    results: list[int | BaseException]
    if batched:
        assert isinstance(engine, BatchedDecode)
        try:
            results = list(engine.step_batch(sessions))
        except Exception as e:
            log.exception("a batched decode step of %d requests failed", len(sessions))
            results = [e] * len(sessions)
    else:
        results = []
        for session in sessions:
            try:
                results.append(session.step())
            except Exception as e:
                results.append(e)
    logprobs: list[TokenLogprobs | None] = []
    for i, (session, result, k) in enumerate(zip(sessions, results, tops)):
        if k is None or isinstance(result, BaseException):
            logprobs.append(None)
            continue
        try:
            logprobs.append(session_logprobs(session, result, k))
        except Exception as e:
            results[i] = e
            logprobs.append(None)
    return results, logprobs, time.monotonic() - began
