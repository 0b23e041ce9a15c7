"""One NIXL agent per rank, owned by one dedicated thread.

NIXL agents are not thread-safe in their default mode (two threads on one agent
crashed), and on DRAM a READ copies inside `transfer()` / `check_xfer_state()`
(256 MiB is tens of ms). So the NIXL calls of an agent run on its own single
worker thread, and the asyncio side awaits that thread: the event loop never
blocks on a long copy and never races the agent.

One exception, for latency: a READ of at most INLINE_MAX_BYTES (1 MiB, ~0.1 ms of copy) is
posted on the caller's thread when the owner thread is idle, saving the two thread hops
(~0.1 ms each here) that dominate a small READ. The owner thread holds a lock around each
call and pump, the inline post takes it only when free (never waits), and the agent runs in
NIXL's STRICT sync mode (one mutex around every agent call), so the agent is still used by one
thread at a time.

The agent runs without NIXL's progress thread (it would spin a whole core); UCX
progresses only when this agent calls into NIXL. Once a CompletionPoller attaches,
the owner thread pumps the agent between calls: every ~1 ms while READs are
tracked or notifications awaited (check each READ, fetch notifications), at a low
idle rate otherwise that backs off while nothing happens (see owner_thread.py), and hands
results to the poller's callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from shared import observe
from shared.cache.memory_place import MemoryPlace
from shared.observe import Step
from shared.transport.errors import (
    PeerAlreadyKnown,
    PeerDisconnected,
    PeerMetadataRejected,
    TransferFailed,
    TransportError,
)
from shared.transport.memory import nixl_descs
from shared.transport.nixl_env import NixlApi, load_nixl
from shared.transport.owner_thread import OwnerThread

T = TypeVar("T")
log = logging.getLogger(__name__)
INLINE_MAX_BYTES = 1 << 20  # READs up to this size may be posted on the caller's thread
XferState = Literal["DONE", "PROC"]
Settle = Callable[["XferState | TransportError"], None]
"""Called on the owner thread when a tracked READ ends: "DONE" or the error."""
NotifSink = Callable[[dict[str, list[bytes]]], None]
"""Called on the owner thread with what a pump's `get_new_notifs()` returned (never empty)."""

# What each NIXL status most likely means here, so an error message says what to do;
# (operation, status) entries win over status-only ones.
_HINTS: dict[str | tuple[str, str], str] = {
    "nixlRemoteDisconnectError": "the peer process died or the connection was lost; remove it and handshake again",
    "nixlNotFoundError": "unknown agent, or descriptors outside its registered memory "
    "(stale metadata after a peer restart? prepare the lists again)",
    "nixlInvalidParamError": "invalid descriptors or indices",
    "nixlBackendError": "the UCX backend failed (peer gone before the connection was made?)",
    "nixlMismatchError": "the metadata is not valid NIXL agent metadata",
    "nixlNotAllowedError": "an agent with this name is already loaded with other connection info",
    ("add remote agent", "nixlInvalidParamError"): "that is this agent's own metadata",
}


def new_incarnation() -> str:
    """A short random tag, so a restarted rank gets an agent name its peers have not seen."""
    return secrets.token_hex(4)


def agent_name(engine_id: str, rank: int, incarnation: str) -> str:
    return f"{engine_id}-r{rank}-{incarnation}"


@dataclass(eq=False)
class PreppedList:
    """A descriptor list prepared once; READs pick descriptors from it by index."""

    handle: Any
    peer: str  # "" for the local side
    place: MemoryPlace
    lengths: npt.NDArray[np.int64]
    released: bool = False
    max_length: int = field(init=False)  # of any descriptor: bounds a READ's bytes by its count

    def __post_init__(self) -> None:
        self.max_length = int(self.lengths.max()) if len(self.lengths) else 0

    def __len__(self) -> int:
        return int(self.lengths.shape[0])


@dataclass(eq=False)
class Xfer:
    """One posted READ. Its NIXL handle is touched only on the agent's owner thread."""

    handle: Any
    peer: str
    nbytes: int
    notif: bytes
    posted_at: float  # time.monotonic() before the post
    state: XferState
    released: bool = False
    post_seconds: float = 0.0  # make_prepped_xfer + transfer() (on DRAM the copy happens inside)
    # Set on the owner thread once NIXL has released the handle: from then on nothing this READ
    # does can touch local memory, so its blocks may be handed to another request.
    release_done: Future[None] = field(default_factory=Future)
    # TEST-ONLY (see RankAgent.test_hold_seconds): until this time the READ stays in flight and
    # cannot be released; then it lands again (a late write) before it ends.
    held_until: float = 0.0
    late_write: tuple[Any, ...] = ()
    tracked: bool = False  # the owner thread polls it from its post on (post_read with settle)


class RankAgent:
    """The NIXL agent of one rank: registration, peers, prepared lists, READs, notifications.

    Async methods run the NIXL call on the owner thread and await it; they may be called
    from one event loop. The object must be closed with `aclose()` (or `close()`).
    """

    def __init__(
        self,
        engine_id: str,
        rank: int,
        *,
        incarnation: str | None = None,
        num_threads: int = 0,
    ) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.name = agent_name(engine_id, rank, incarnation or new_incarnation())
        self._api: NixlApi = load_nixl()
        self._place: MemoryPlace | None = None
        self._registered: Any = None
        self._tensors: list[torch.Tensor] = []  # kept alive: peers may read them
        self._prepped: set[PreppedList] = set()
        self._live: set[Xfer] = set()
        self._unreleased: list[Xfer] = []  # cancel failed; retried on every pump
        # Pump state, owned by the owner thread (changed only through submitted calls).
        self._tracked: dict[Xfer, Settle] = {}
        self._sink: NotifSink | None = None
        self._busy_interval = 0.001
        self._idle_interval: float | None = None
        self._keep_busy = False
        self.pumps = 0  # how often the owner thread pumped (read-only elsewhere)
        # TEST-ONLY fake of a READ that cannot be cancelled for a while (a slow network or NIC):
        # READs posted while this is > 0 stay in flight that many seconds, refuse release until
        # then, and write their bytes again when they end. Nothing in production sets it.
        self.test_hold_seconds = 0.0
        self._closed = False
        self._owner = OwnerThread(f"nixl-{self.name}", self._pump, self._pump_interval)
        try:
            self._agent: Any = self._owner.submit(self._create, num_threads).result()
        except BaseException:
            self._closed = True
            self._owner.stop()
            raise

    @classmethod
    async def create(cls, engine_id: str, rank: int, *, incarnation: str | None = None, num_threads: int = 0) -> RankAgent:
        """Build an agent without blocking the event loop (the first one takes ~0.4 s)."""
        return await asyncio.to_thread(functools.partial(cls, engine_id, rank, incarnation=incarnation, num_threads=num_threads))

    @property
    def place(self) -> MemoryPlace:
        if self._place is None:
            raise RuntimeError(f"agent {self.name}: no memory registered yet")
        return self._place

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owner_thread(self) -> threading.Thread:
        return self._owner.thread

    @property
    def live_xfers(self) -> int:
        """READs whose handles are not released yet (in flight, or a cancel that failed)."""
        return len(self._live)

    # ---- async API (each call is one hop to the owner thread) ----

    async def register(self, tensors: Sequence[torch.Tensor]) -> MemoryPlace:
        """Register the rank's cache tensors (contiguous, one device) once."""
        return await self._call(self._register, list(tensors))

    async def metadata(self) -> bytes:
        return await self._call(lambda: bytes(self._agent.get_agent_metadata()))

    async def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata and connect; returns the peer's agent name."""
        return await self._call(self._add_remote, metadata)

    async def remove_remote(self, name: str) -> None:
        """Drop a peer (never fails, also for unknown names). Its prepared lists become invalid."""
        await self._call(self._agent.remove_remote_agent, name)

    async def prep_local(self, descs: npt.ArrayLike) -> PreppedList:
        """Prepare local descriptors (Nx2 address, length) inside the registered memory."""
        return await self._call(self._prep, "", descs, None)

    async def prep_remote(self, name: str, descs: npt.ArrayLike, place: MemoryPlace) -> PreppedList:
        """Prepare a peer's descriptors (Nx2) in its memory at `place` (sent in its handshake)."""
        return await self._call(self._prep, name, descs, place)

    async def release_prepped(self, prepped: PreppedList) -> None:
        await self._call(self._release_prepped, prepped)

    def post_read(
        self,
        local: PreppedList,
        local_idx: npt.ArrayLike,
        remote: PreppedList,
        remote_idx: npt.ArrayLike,
        notif: bytes,
        settle: Settle | None = None,
    ) -> asyncio.Future[Xfer]:
        """ONE prepared READ of remote[remote_idx[i]] into local[local_idx[i]], then post it.
        With `settle`, a READ the owner thread posts and finds still in flight is tracked in the
        same job (see `track`); a READ posted inline is the caller's to track.

        A READ of at most INLINE_MAX_BYTES is posted right here when the owner thread is idle
        (the returned future is then already done); otherwise it is handed to the owner thread
        at once (not when first awaited). Await the returned future for the Xfer.
        On DRAM the copy usually happens inside this call (state "DONE", notification already
        sent, handle released right after, before this agent's next call); otherwise the state is "PROC" and someone
        must poll it to the end (the CompletionPoller, or `state()`): the notification
        only leaves from that polling.
        """
        small = np.size(local_idx) * local.max_length <= INLINE_MAX_BYTES
        if not self._closed and small and not self.test_hold_seconds:
            posted: asyncio.Future[Xfer] = asyncio.get_running_loop().create_future()
            try:
                ran, xfer = self._owner.try_inline(self._post_read, local, local_idx, remote, remote_idx, notif, True)
            except Exception as exc:  # delivered through the future, as from the owner thread
                posted.set_exception(exc)
                return posted
            if ran:
                assert xfer is not None
                posted.set_result(xfer)
                return posted
        return self._call_now(self._post_read, local, local_idx, remote, remote_idx, notif, False, settle)

    async def state(self, xfer: Xfer) -> XferState:
        """Poll one READ; a finished or failed READ has its handle released."""
        result = await self._call(self._poll_one, xfer)
        if isinstance(result, TransportError):
            raise result
        return result

    async def release(self, xfer: Xfer) -> None:
        """Release a READ's handle, cancelling it if still in flight, and return once NIXL has
        released it (a cancel that fails is retried by every pump until it succeeds)."""
        await self._call(self._release_xfer, xfer)
        await asyncio.wrap_future(xfer.release_done)

    async def send_notif(self, name: str, msg: bytes) -> None:
        await self._call(self._send_notif, name, msg)

    async def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Fetch notifications directly (not while a poller pumps this agent: it would miss them)."""
        return await self._call(self._get_new_notifs)

    async def aclose(self) -> None:
        """Release every handle, deregister memory, destroy the agent, stop the owner thread."""
        if self._closed:
            return
        self._closed = True  # refuse new calls; ones already queued run before the destroy
        await asyncio.wrap_future(self._owner.submit(self._destroy))
        await asyncio.to_thread(self._owner.stop)

    def close(self) -> None:
        """Blocking `aclose()` for code outside an event loop."""
        if self._closed:
            return
        self._closed = True
        self._owner.submit(self._destroy).result()
        self._owner.stop()

    # ---- pumping, driven by the CompletionPoller (thread-safe, return at once) ----

    def start_pump(self, sink: NotifSink, *, busy_interval: float, idle_interval: float | None) -> None:
        """Pump between calls: every `busy_interval` s while READs are tracked or `set_busy`,
        else every `idle_interval` s (None: not at all); notifications go to `sink`."""
        self._submit_quietly(self._set_pump, sink, busy_interval, idle_interval)

    def stop_pump(self) -> Future[None]:
        return self._submit_quietly(self._set_pump, None, self._busy_interval, None)

    def wake(self) -> None:
        """Pump at the idle rate again if backed off: a peer is about to connect, and without
        a progress thread its connection wire-up needs this agent's answers."""
        if not self._closed:
            self._owner.wake()

    def set_busy(self, busy: bool) -> None:
        """Pump at the busy rate even with nothing tracked (someone awaits notifications)."""
        self._submit_quietly(setattr, self, "_keep_busy", busy)

    def track(self, xfer: Xfer, settle: Settle) -> None:
        """Poll a posted READ on every pump until it ends, then call `settle` (owner thread)."""
        self._submit_quietly(self._track, xfer, settle)

    def drop(self, xfer: Xfer) -> Future[bool]:
        """Stop tracking a READ and release its handle (cancels it if in flight)."""
        return self._submit_quietly(self._release_xfer, xfer)

    # ---- owner-thread side ----

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError(f"agent {self.name} is closed")
        return await asyncio.wrap_future(self._owner.submit(fn, *args))

    def _call_now(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`_call`, submitted before returning; errors (a closed agent too) come out of the await."""
        if self._closed:
            closed: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            closed.set_exception(RuntimeError(f"agent {self.name} is closed"))
            return closed
        return asyncio.wrap_future(self._owner.submit(fn, *args))

    def _submit_quietly(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        if self._closed:
            done: Future[T] = Future()
            done.set_exception(RuntimeError(f"agent {self.name} is closed"))
            done.exception()  # mark retrieved: callers may ignore this future
            return done
        return self._owner.submit(fn, *args)

    def _create(self, num_threads: int) -> Any:
        # STRICT: NIXL's own mutex around every agent call, as small READs are posted from the
        # event-loop thread (one thread at a time, see the module docstring).
        strict = self._api.module.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        config = self._api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], num_threads=num_threads, sync_mode=strict
        )
        agent = self._api.nixl_agent(self.name, config)
        if "UCX" not in agent.backends:
            raise TransportError(f"agent {self.name}: the NIXL UCX backend plugin is not available")
        return agent

    def _set_pump(self, sink: NotifSink | None, busy_interval: float, idle_interval: float | None) -> None:
        self._sink = sink
        self._busy_interval = busy_interval
        self._idle_interval = idle_interval

    def _has_work(self) -> bool:
        return bool(self._tracked or self._unreleased or (self._keep_busy and self._sink is not None))

    def _pump_interval(self) -> float | None:
        if self._has_work():
            return self._busy_interval
        return self._idle_interval if self._sink is not None else None

    def _pump(self) -> bool:
        """One pump; True when it had work or found some (the owner thread backs off otherwise)."""
        if self._agent is None:
            return False
        self.pumps += 1
        found = self._has_work()
        for xfer, settle in list(self._tracked.items()):
            result = self._poll_one(xfer)
            if result != "PROC":  # already released, which also untracked it
                _settle_safely(settle, result)
        if self._unreleased:
            self._unreleased = [x for x in self._unreleased if not self._release_xfer(x)]
        if self._sink is not None:
            notifs = self._get_new_notifs()
            if notifs:
                observe.mark(Step.NOTIFICATION_FETCHED)
                self._sink(notifs)
                found = True
        return found

    def _track(self, xfer: Xfer, settle: Settle) -> None:
        if xfer.released:  # ended (or was dropped) before tracking began
            _settle_safely(settle, self._poll_one(xfer))
            return
        self._tracked[xfer] = settle

    def _register(self, tensors: list[torch.Tensor]) -> MemoryPlace:
        if self._registered is not None:
            raise RuntimeError(f"agent {self.name}: memory is registered once per rank")
        place = MemoryPlace.of_tensors(tensors)
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError(f"agent {self.name}: cache tensors must be contiguous")
        self._registered = self._nixl("register memory", "", self._agent.register_memory, tensors)
        self._tensors = tensors
        self._place = place
        return place

    def _add_remote(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except self._api.error_named("nixlNotAllowedError") as exc:
            raise PeerAlreadyKnown(
                f"agent {self.name}: a peer with this agent name is already loaded with other "
                "connection info (a restarted peer reusing its name); remove_remote it first",
                nixl_error=type(exc).__name__,
            ) from exc
        except self._api.errors as exc:
            raise self._wrap(exc, "add remote agent", "") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def _prep(self, peer: str, descs: npt.ArrayLike, place: MemoryPlace | None) -> PreppedList:
        where = self.place if place is None else place
        rows = nixl_descs(descs, where)
        handle = self._nixl(
            "prepare descriptors",
            peer,
            self._agent.prep_xfer_dlist,
            peer if peer else "NIXL_INIT_AGENT",
            rows,
            where.mem_type,
        )
        prepped = PreppedList(handle, peer, where, rows[:, 1].astype(np.int64))
        self._prepped.add(prepped)
        return prepped

    def _release_prepped(self, prepped: PreppedList) -> None:
        if not prepped.released:
            prepped.handle.release()
            prepped.released = True
        self._prepped.discard(prepped)

    def _post_read(
        self,
        local: PreppedList,
        local_idx: npt.ArrayLike,
        remote: PreppedList,
        remote_idx: npt.ArrayLike,
        notif: bytes,
        inline: bool = False,
        settle: Settle | None = None,
    ) -> Xfer:
        observe.mark(Step.POST_START)
        if local.peer or not remote.peer:
            raise ValueError("post_read takes a local prepared list, then a remote one")
        if local.released or remote.released:
            raise ValueError("post_read on a released prepared list")
        lidx = _indices(local_idx, len(local), "local")
        ridx = _indices(remote_idx, len(remote), "remote")
        if lidx.shape != ridx.shape:
            raise ValueError(f"{lidx.shape[0]} local indices but {ridx.shape[0]} remote ones")
        lens = local.lengths[lidx]
        remote_lens = remote.lengths[ridx]
        if not np.array_equal(lens, remote_lens):
            mismatch = np.flatnonzero(lens != remote_lens)
            i = int(mismatch[0])
            raise ValueError(
                f"{mismatch.size} descriptor pairs differ in length, first at position {i}: "
                f"local[{int(lidx[i])}] {int(lens[i])} B vs remote[{int(ridx[i])}] "
                f"{int(remote.lengths[ridx[i]])} B"
            )
        posted_at = time.monotonic()
        held = self.test_hold_seconds > 0  # TEST-ONLY: its notification leaves when it lands late
        handle = self._nixl(
            "prepare READ",
            remote.peer,
            self._agent.make_prepped_xfer,
            "READ",
            local.handle,
            lidx,
            remote.handle,
            ridx,
            b"" if held else notif,
        )
        xfer = Xfer(handle, remote.peer, int(lens.sum()), notif, posted_at, "PROC")
        self._live.add(xfer)
        try:
            state = self._agent.transfer(handle)
        except self._api.errors as exc:
            self._release_xfer(xfer)
            raise self._wrap(exc, "READ", remote.peer) from exc
        xfer.post_seconds = time.monotonic() - posted_at
        if held and state != "ERR":
            xfer.held_until = time.monotonic() + self.test_hold_seconds
            xfer.late_write = (local.handle, lidx, remote.handle, ridx)
            state = "PROC"
        if state == "ERR":
            self._release_xfer(xfer)
            raise TransferFailed(f"READ from peer {remote.peer!r} failed when posted", peer=remote.peer)
        if state == "DONE":
            xfer.state = "DONE"
            if inline:  # small: releasing costs little, and the caller holds the agent now
                self._release_xfer(xfer)
            else:
                # Released by the owner thread right after the caller has the result: releasing a
                # large request's handle takes ~0.1 ms the caller need not wait for.
                self._owner.after_job(self._release_xfer, xfer)
        elif settle is not None:
            self._tracked[xfer] = settle
            xfer.tracked = True
        observe.mark(Step.POST_END)
        return xfer

    def _poll_one(self, xfer: Xfer) -> XferState | TransportError:
        if self._held(xfer, completes=True):
            return "PROC"
        if xfer.released:
            if xfer.state == "DONE":
                return "DONE"
            return TransferFailed(f"READ from peer {xfer.peer!r} was released before it finished", peer=xfer.peer)
        try:
            state = self._agent.check_xfer_state(xfer.handle)
        except self._api.errors as exc:
            self._release_xfer(xfer)
            return self._wrap(exc, "READ", xfer.peer)
        if state == "ERR":
            self._release_xfer(xfer)
            return TransferFailed(f"READ from peer {xfer.peer!r} failed", peer=xfer.peer)
        if state == "DONE":
            xfer.state = "DONE"
            self._release_xfer(xfer)
            return "DONE"
        return "PROC"

    def _release_xfer(self, xfer: Xfer) -> bool:
        self._tracked.pop(xfer, None)  # whoever releases it no longer waits for it
        if xfer.released:
            return True
        try:
            if self._held(xfer, completes=False):
                return self._keep_for_release(xfer)
            xfer.handle.release()
        except self._api.errors:
            # NIXL could not cancel the in-flight request; keep it and try again later.
            return self._keep_for_release(xfer)
        self._mark_released(xfer)
        return True

    def _keep_for_release(self, xfer: Xfer) -> bool:
        if xfer not in self._unreleased:
            self._unreleased.append(xfer)
        return False

    def _mark_released(self, xfer: Xfer) -> None:
        xfer.released = True
        self._live.discard(xfer)
        if not xfer.release_done.done():
            xfer.release_done.set_result(None)

    def _held(self, xfer: Xfer, *, completes: bool) -> bool:
        """TEST-ONLY hold (see test_hold_seconds): True while the READ must stay in flight; when
        the hold ends, the READ writes its bytes again, as a transfer landing late would, with its
        notification if it `completes` (a cancelled READ sends none)."""
        if not xfer.held_until:
            return False
        if time.monotonic() < xfer.held_until:
            return True
        xfer.held_until = 0.0
        late = self._agent.make_prepped_xfer("READ", *xfer.late_write, xfer.notif if completes else b"")
        try:
            state = self._agent.transfer(late)
            while state == "PROC":
                time.sleep(0.001)
                state = self._agent.check_xfer_state(late)
        finally:
            late.release()
        return False

    def _get_new_notifs(self) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self._nixl("get notifications", "", self._agent.get_new_notifs)
        return notifs

    def _send_notif(self, name: str, msg: bytes) -> None:
        self._nixl("send notification", name, self._agent.send_notif, name, msg)

    def _destroy(self) -> None:
        closing = TransportError(f"agent {self.name} was closed with the READ in flight")
        for settle in list(self._tracked.values()):
            _settle_safely(settle, closing)
        self._tracked.clear()
        self._sink = None
        for xfer in list(self._live):
            if not self._release_xfer(xfer):
                self._mark_released(xfer)  # the agent goes away with it: nothing can land any more
        for prepped in list(self._prepped):
            self._release_prepped(prepped)
        if self._registered is not None:
            with contextlib.suppress(*self._api.errors):  # the agent is going away regardless
                self._agent.deregister_memory(self._registered)
            self._registered = None
        self._tensors = []
        # Drop the last reference here so the agent is destroyed on its owner thread.
        self._agent = None

    def _nixl(self, what: str, peer: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except self._api.errors as exc:
            raise self._wrap(exc, what, peer) from exc

    def _wrap(self, exc: BaseException, what: str, peer: str) -> TransportError:
        kind = type(exc).__name__
        hint = _HINTS.get((what, kind), _HINTS.get(kind, ""))
        with_peer = f" with peer {peer!r}" if peer else ""
        message = f"agent {self.name}: {what}{with_peer} failed: {kind} ({exc})"
        if hint:
            message += f": {hint}"
        return _error_class(what, kind)(message, peer=peer, nixl_error=kind)


def _error_class(what: str, kind: str) -> type[TransportError]:
    """The typed error for a NIXL exception class name `kind` raised by operation `what`."""
    if what == "add remote agent" and kind in ("nixlMismatchError", "nixlInvalidParamError"):
        return PeerMetadataRejected
    if what in ("READ", "prepare READ"):
        return PeerDisconnected if kind == "nixlRemoteDisconnectError" else TransferFailed
    return TransportError


def _settle_safely(settle: Settle, result: XferState | TransportError) -> None:
    try:
        settle(result)
    except Exception:
        log.exception("a READ completion callback failed")


def _indices(idx: npt.ArrayLike, size: int, side: str) -> npt.NDArray[np.int32]:
    """Checked indices as int32, the dtype NIXL documents for index arrays (exact: range-checked first)."""
    arr = np.asarray(idx)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{side} indices must be a non-empty 1-D array")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{side} indices must be integers, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= min(size, 2**31):
        raise ValueError(f"{side} index out of range [0, {size}): min {lo}, max {hi}")
    return np.ascontiguousarray(arr, dtype=np.int32)
