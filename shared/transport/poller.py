"""ONE completion poller per process: every READ in flight and every awaited notification.

Without NIXL's progress thread nothing moves unless someone calls into the agent:
the initiator's `check_xfer_state()` completes a READ and is also what sends its
notification; the target's `get_new_notifs()` answers connection wire-up and
receives notifications. So every attached agent is pumped by its owner thread:

- about every `busy_interval` (>= 1 ms) while it has READs in flight or someone
  awaits notifications on it: each READ is checked, notifications fetched;
- every `idle_interval` otherwise (keeps wire-up answered, drains stray messages),
  doubling while those pumps find nothing, up to owner_thread.MAX_IDLE_WAIT (1 s), and
  back at `idle_interval` after any call on the agent; or not at all (None);
- it calls back here only when a READ ended or notifications arrived.

The ticking lives on the owner threads because a 1 ms asyncio tick that hops to a
thread cost ~5x the CPU (see owner_thread.py). This object holds what the event
loop needs: one future per READ, one deadline per READ (a frozen peer leaves a READ
in PROC forever), cancellation that releases the handle, and notification routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy.typing as npt

from shared.transport.agent import PreppedList, RankAgent, Xfer, XferState
from shared.transport.errors import TransferFailed, TransferTimedOut, TransportError
from shared.transport.notifications import NotificationRouter, UnknownHandler
from shared.transport.read_fence import ReadFence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadResult:
    peer: str
    nbytes: int
    seconds: float  # from the post to the observed completion
    post_seconds: float = 0.0  # make_prepped_xfer + transfer() (on DRAM the copy happens inside)


@dataclass
class PollerStats:
    reads_posted: int = 0
    reads_done: int = 0
    reads_failed: int = 0
    reads_timed_out: int = 0
    reads_cancelled: int = 0
    bytes_read: int = 0
    notifs_received: int = 0
    notifs_unknown: int = 0


class CompletionPoller:
    """Drives READs to completion and routes notifications for every agent of the process.

    Use from one event loop. Attach each agent whose notifications matter (targets too).
    """

    def __init__(
        self,
        *,
        busy_interval: float = 0.001,
        idle_interval: float | None = 0.02,
        on_unknown_notif: UnknownHandler | None = None,
    ) -> None:
        if busy_interval < 0.001:
            raise ValueError("busy_interval below 1 ms turns the pump into a busy spin")
        self.busy_interval = busy_interval
        self.idle_interval = idle_interval
        self.router = NotificationRouter(on_unknown_notif)
        self._stats = PollerStats()
        self._agents: dict[str, RankAgent] = {}
        self._active: dict[Xfer, tuple[RankAgent, asyncio.Future[ReadResult]]] = {}
        self._drops: set[asyncio.Future[bool]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def stats(self) -> PollerStats:
        counts = dict(self._stats.__dict__, notifs_received=self.router.received, notifs_unknown=self.router.unknown)
        return PollerStats(**counts)

    @property
    def in_flight(self) -> int:
        """READs being waited for."""
        return len(self._active)

    def attach(self, agent: RankAgent) -> None:
        """Pump this agent from now on (initiators and targets both need it)."""
        if self._closed:
            raise RuntimeError("the completion poller is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if agent.name in self._agents:
            return
        self._agents[agent.name] = agent
        agent.start_pump(
            functools.partial(self._notifs_from_owner_thread, agent.name),
            busy_interval=self.busy_interval,
            idle_interval=self.idle_interval,
        )

    def detach(self, agent: RankAgent) -> None:
        """Stop pumping an agent (READs it still tracks keep being polled until they end)."""
        if self._agents.pop(agent.name, None) is not None:
            agent.stop_pump()

    def expect(self, agent: RankAgent, key: bytes, count: int) -> asyncio.Future[list[str]]:
        """Wait for `count` notifications `key` on `agent` (see NotificationRouter.expect).

        Register before the reader can send them; the agent is pumped at the busy rate
        until every wait on it is resolved or cancelled.
        """
        self.attach(agent)
        future = self.router.expect(agent.name, key, count)
        agent.set_busy(True)
        future.add_done_callback(lambda _: self._update_busy(agent))
        return future

    async def read(
        self,
        agent: RankAgent,
        local: PreppedList,
        local_idx: npt.ArrayLike,
        remote: PreppedList,
        remote_idx: npt.ArrayLike,
        notif: bytes,
        *,
        timeout: float,
        fence: ReadFence | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> ReadResult:
        """Post ONE READ and wait for it, at most `timeout` seconds from now: the one way this
        project moves state.

        One owner-thread job posts it and, when it is still in flight, tracks it (a small READ
        may be posted inline instead). `on_posted` runs once the post has finished with the index
        arrays (done or failed), so their buffers can be reused. `fence` gets the READ as soon as
        it is posted. The result comes only once NIXL has released the handle. Raises
        TransferFailed (a NIXL error; names the peer) or TransferTimedOut at the deadline (the
        handle is released after: see `fence`). Cancelling the caller cancels the READ.
        """
        self.attach(agent)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        done: asyncio.Future[ReadResult] = loop.create_future()

        def settle(result: XferState | TransportError) -> None:  # on the owner thread
            with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody waits any more
                loop.call_soon_threadsafe(self._settle, done, post, result)

        post = agent.post_read(local, local_idx, remote, remote_idx, notif, settle)
        if on_posted is not None:
            post.add_done_callback(lambda _: on_posted())
        if fence is not None:
            fence.add(agent, post)
        try:
            xfer = await asyncio.shield(post)
        except asyncio.CancelledError:
            post.add_done_callback(functools.partial(self._drop_posted, agent))
            self._stats.reads_cancelled += 1
            raise
        except TransferFailed:
            self._stats.reads_failed += 1
            raise
        self._stats.reads_posted += 1
        if xfer.state == "DONE":
            self._settle(done, post, "DONE")
        elif not xfer.tracked:
            agent.track(xfer, settle)  # posted inline: the owner thread has not seen it yet
        self._active[xfer] = (agent, done)
        timer = loop.call_at(deadline, self._expire, agent, xfer, done, timeout)
        try:
            result = await done
            if not xfer.release_done.done():  # a DONE READ is released right after its post
                await asyncio.wrap_future(xfer.release_done)
            return result
        except asyncio.CancelledError:
            if not done.done() or done.cancelled():
                self._stats.reads_cancelled += 1
                self._drop(agent, xfer)
            raise
        finally:
            timer.cancel()
            self._active.pop(xfer, None)

    async def aclose(self) -> None:
        """Stop pumping; READs still awaited fail and their handles are released."""
        if self._closed:
            return
        self._closed = True
        closing = TransportError("the completion poller was closed with the READ in flight")
        for xfer, (agent, future) in list(self._active.items()):
            if not future.done():
                future.set_exception(closing)
                self._drop(agent, xfer)
        stops = [asyncio.wrap_future(agent.stop_pump()) for agent in self._agents.values()]
        self._agents.clear()
        await asyncio.gather(*stops, *self._drops, return_exceptions=True)

    # ---- internals ----

    def _settle(self, future: asyncio.Future[ReadResult], post: asyncio.Future[Xfer], result: XferState | TransportError) -> None:
        if future.done():
            return  # timed out, cancelled or closed meanwhile
        xfer = post.result()  # the post finished before its READ could be settled
        if isinstance(result, TransportError):
            self._stats.reads_failed += 1
            future.set_exception(result)
        elif result == "DONE":
            self._stats.reads_done += 1
            self._stats.bytes_read += xfer.nbytes
            future.set_result(ReadResult(xfer.peer, xfer.nbytes, time.monotonic() - xfer.posted_at, xfer.post_seconds))

    def _expire(self, agent: RankAgent, xfer: Xfer, future: asyncio.Future[ReadResult], timeout: float) -> None:
        if future.done():
            return
        self._stats.reads_timed_out += 1
        future.set_exception(
            TransferTimedOut(
                f"READ of {xfer.nbytes} B from peer {xfer.peer!r} did not finish within "
                f"{timeout:.3g} s (peer frozen or overloaded?); its handle is being released",
                peer=xfer.peer,
            )
        )
        self._drop(agent, xfer)

    def _drop(self, agent: RankAgent, xfer: Xfer) -> None:
        dropping = asyncio.wrap_future(agent.drop(xfer))
        self._drops.add(dropping)
        dropping.add_done_callback(self._drop_done)

    def _drop_done(self, dropping: asyncio.Future[bool]) -> None:
        self._drops.discard(dropping)
        if not dropping.cancelled() and dropping.exception() is not None:
            log.warning("releasing a READ handle failed: %s", dropping.exception())

    def _drop_posted(self, agent: RankAgent, post: asyncio.Future[Xfer]) -> None:
        if not post.cancelled() and post.exception() is None and not post.result().released:
            self._drop(agent, post.result())

    def _update_busy(self, agent: RankAgent) -> None:
        if not self._closed and agent.name in self._agents:
            agent.set_busy(self.router.pending(agent.name) > 0)

    def _notifs_from_owner_thread(self, agent_name: str, notifs: dict[str, list[bytes]]) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is gone
            loop.call_soon_threadsafe(self.router.dispatch, agent_name, notifs)
