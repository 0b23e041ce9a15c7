"""One prefill engine as decode sees it: channel, handshake, link, session, and reconnects.

`run()` loops for the life of the service: handshake, link (add the prefill's agents, prepare
the lists, probe READ), open the Session, serve until the stream ends; then drop the link
(waiting for requests still reading through it, which fail with the session) so the remote
agents are removed, and retry with exponential backoff and full jitter, up to
`--reconnect-max-seconds`. A prefill that refuses our handshake as incompatible (another model
or layout) will not change by itself soon: it is logged at ERROR once per distinct refusal and
retried at the cap from then on; other failures log a WARNING (rate limited by the log filter). Whatever fails in an
attempt is recorded in `last_error` (GetLayout shows it) and retried; nothing ends the loop but
the service stopping. Requests only go to a peer in state READY.

A peer learned from a request (`once=True`, decode_svc/learned_peers.py) makes one attempt: when
it fails or its session ends, the loop ends and the peer is forgotten; the next request that
names that prefill engine handshakes with it afresh.

A peer remembers the link of its last READY session after losing it (`last_link`, closed: only
its layout is read): decode's state checkpoints are keyed by that engine's chain, and a request
whose prompt has one decodes from it while no prefill engine is ready (`PrefillPeers.known_links`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Callable, Collection

import grpc

from decode_svc.peer_link import PeerLink
from decode_svc.prefill_load import PeerLoad, peer_load
from decode_svc.session_client import SessionClient
from shared.config import TlsSettings
from shared.errors import FailedPrecondition, ServiceError, Unavailable
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.channel import HANDSHAKE_TIMEOUT_SECONDS, build_channel
from shared.rpc.status import describe
from shared.runtime.engine_host import EngineHost

log = logging.getLogger(__name__)

BACKOFF_INITIAL_SECONDS = 0.1
BACKOFF_MAX_SECONDS = 2.0  # the default of --reconnect-max-seconds
# A retired peer (its address vanished from DNS) waits this long for the requests still using it.
RETIRE_WAIT_SECONDS = 120.0
# A request that picked the peer just before it retired is not counted in flight until it has
# sent its job; it re-picks if it sees the peer retiring first. This covers the gap between.
RETIRE_GRACE_SECONDS = 1.0


class HandshakeRefused(Exception):
    """The prefill answered our Handshake with an error (FAILED_PRECONDITION: incompatible)."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        super().__init__(str(error))
        self.error = error


class PrefillPeer:
    def __init__(
        self,
        target: str,
        host: EngineHost,
        tls: TlsSettings | None,
        on_state_change: Callable[[], None] = lambda: None,
        *,
        max_pinned_requests: int = 0,
        server_name: str | None = None,
        reconnect_max_seconds: float = BACKOFF_MAX_SECONDS,
        once: bool = False,
    ) -> None:
        self.reconnect_max_seconds = reconnect_max_seconds
        self.attempts = 0  # connection attempts so far (tests, debugging)
        self._refusal_logged = ""  # the incompatibility last logged at ERROR
        self.target = target
        self.once = once  # no reconnects: the loop ends with the first failure or session end
        self.settled = asyncio.Event()  # set once the first attempt is READY or FAILED
        self.server_name = server_name  # the DNS name `target` was found under (TLS checks it)
        self.retiring = False  # its address vanished: no new requests, then closed
        self.host = host
        self.tls = tls
        self.max_pinned_requests = max_pinned_requests  # credits asked for (0: prefill's default)
        self.on_state_change = on_state_change
        self.state: int = dpb.PEER_STATE_CONNECTING
        self.last_error = ""
        self.link: PeerLink | None = None
        # The link of the last READY session, kept once it is lost (then closed: no NIXL through it).
        self.last_link: PeerLink | None = None
        self.session: SessionClient | None = None
        # Requests picked for this peer whose job is not on its session yet (they wait for
        # blocks, or their job task has not run): counted in `load`, so that a burst picked
        # before any of its jobs is sent sees the jobs ahead of it.
        self._routed: dict[str, int] = {}  # request id: the prompt tokens its job will compute
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return f"{self.link.engine_id} ({self.target})" if self.link is not None else self.target

    @property
    def ready(self) -> bool:
        s = self.session
        return (
            self.state == dpb.PEER_STATE_READY
            and s is not None
            and not s.closed.is_set()
            and not s.draining
            and not self.retiring
        )

    @property
    def load(self) -> PeerLoad:
        """This decode engine's requests on the peer right now (routed to it or on its session),
        with the peer's latest report."""
        s, link = self.session, self.link
        if s is None or link is None:
            return peer_load(0, None, 1)
        return peer_load(s.in_flight + len(self._routed), s.load, link.remote.num_logical_blocks)

    @property
    def queued_tokens(self) -> int:
        """The prompt tokens a new job would wait behind here: this engine's jobs waiting for a
        manifest or routed here, and the other decode engines' as last reported."""
        s = self.session
        if s is None:
            return 0
        others = s.load.other_prompt_tokens if s.load is not None else 0
        return s.queued_tokens + sum(self._routed.values()) + others

    def route(self, request_id: str, tokens: int) -> None:
        """The request was picked for this peer, its job to compute `tokens` prompt tokens: it
        counts in `load` and `queued_tokens` until `unroute`."""
        self._routed[request_id] = tokens

    def unroute(self, request_id: str) -> None:
        """Its job goes on the session now (which counts it from then on), or it will not come
        (it ended, or another peer takes it). Idempotent."""
        self._routed.pop(request_id, None)

    @property
    def busy(self) -> bool:
        """Requests still waiting for a manifest, holding one, or reading through the link."""
        s, link = self.session, self.link
        return (s is not None and not s.closed.is_set() and s.in_flight > 0) or (link is not None and link.readers > 0)

    async def retire(self) -> None:
        """Drain, then close: no new requests from now on; those in flight finish (bounded by
        RETIRE_WAIT_SECONDS); then the session and link go."""
        self.retiring = True
        self.on_state_change()
        try:
            async with asyncio.timeout(RETIRE_WAIT_SECONDS):
                await asyncio.sleep(RETIRE_GRACE_SECONDS)
                while self.busy:
                    await asyncio.sleep(0.05)
        except TimeoutError:
            log.warning("prefill %s: retired with requests still in flight after %g s", self.name, RETIRE_WAIT_SECONDS)
        await self.aclose()
        log.info("prefill %s: retired", self.name)

    def status(self) -> dpb.PrefillPeerStatus:
        return dpb.PrefillPeerStatus(
            target=self.target,
            state=self.state,  # type: ignore[arg-type]
            engine_id=self.link.engine_id if self.link else "",
            incarnation=self.link.incarnation if self.link else 0,
            last_error=self.last_error,
        )

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.ensure_future(self.run())
        self._task.add_done_callback(self._loop_ended)
        return self._task

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.last_error = f"INTERNAL: the connection loop died: {task.exception()!r}"
            log.error("prefill %s: the connection loop died", self.target, exc_info=task.exception())

    async def run(self) -> None:
        backoff = BACKOFF_INITIAL_SECONDS
        while True:
            self.attempts += 1
            incompatible = False
            # A fresh channel per attempt: it connects at once, so our backoff (with jitter) alone
            # decides when to retry, not the channel's own reconnect backoff on top of it.
            try:
                self._channel = build_channel(self.target, self.tls, self.server_name)
                stub = pb_grpc.PrefillServiceStub(self._channel)
                await self._connect(stub)
                backoff = BACKOFF_INITIAL_SECONDS
                self._refusal_logged = ""
                assert self.session is not None
                await self.session.closed.wait()
                self.last_error = self.session.close_reason
                log.warning("%s", self.last_error)
            except HandshakeRefused as e:
                failure = describe(e.error)
                self.last_error = f"{failure.status}: {failure.message}"
                incompatible = failure.status == "FAILED_PRECONDITION"
                if not incompatible:
                    log.warning("prefill %s: %s", self.target, self.last_error)
                elif self.last_error != self._refusal_logged:
                    log.error(
                        "prefill %s refuses this decode engine: %s (retrying every %gs)",
                        self.target, self.last_error, self.reconnect_max_seconds,
                    )  # fmt: skip
                    self._refusal_logged = self.last_error
            except grpc.aio.AioRpcError as e:
                failure = describe(e)
                self.last_error = f"{failure.status}: {failure.message}"
                log.warning("prefill %s: %s", self.target, self.last_error)
            except ServiceError as e:
                self.last_error = f"{e.status}: {e.message}"
                log.warning("prefill %s: %s", self.target, self.last_error)
            except Exception as e:  # a bug or an unexpected NIXL error: record it, never stop retrying
                self.last_error = f"INTERNAL: {type(e).__name__}: {e}"
                log.exception("prefill %s: connecting failed", self.target)
            self._set_state(dpb.PEER_STATE_FAILED)
            await self._disconnect()
            await self._close_channel()
            if self.once:
                return
            if incompatible:
                backoff = self.reconnect_max_seconds  # it will not change by itself soon: retry slowly
            # Full jitter: peers that lost the same prefill do not reconnect in lockstep.
            await asyncio.sleep(random.uniform(0.5, 1.0) * backoff)
            backoff = min(backoff * 2, self.reconnect_max_seconds)

    async def _connect(self, stub: pb_grpc.PrefillServiceAsyncStub) -> None:
        self._set_state(dpb.PEER_STATE_CONNECTING)
        # Not wait_for_ready: an unreachable peer fails at once with the reason (our loop retries).
        try:
            response = await stub.Handshake(pb.HandshakeRequest(layout=self.host.message), timeout=HANDSHAKE_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as e:
            raise HandshakeRefused(e) from None
        remote = response.layout
        self.link = await PeerLink.open(self.host, self.target, remote)
        session = SessionClient(stub, self.name, self.link.manifest_source(self.host.verify_transfer))
        self.session = session
        await session.open(
            pb.SessionHello(
                decode_engine_id=self.host.engine_id,
                decode_incarnation=self.host.incarnation,
                prefill_incarnation=remote.incarnation,
                readers_per_prefill_rank=self.link.readers_per_prefill_rank(),
                max_pinned_requests=self.max_pinned_requests,
            )
        )
        self.last_error = ""
        self.last_link = self.link
        self._set_state(dpb.PEER_STATE_READY)
        log.info("prefill %s ready (incarnation %016x)", self.name, remote.incarnation)

    async def _disconnect(self) -> None:
        """Close the session and drop the link: its remote agents are removed once no request
        reads through it (the next attempt adds whatever incarnation answers then)."""
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.link is not None:
            link, self.link = self.link, None
            await link.close(self.host)

    def _set_state(self, state: int) -> None:
        if state in (dpb.PEER_STATE_READY, dpb.PEER_STATE_FAILED):
            self.settled.set()
        if state != self.state:
            self.state = state
            self.on_state_change()

    async def aclose(self) -> None:
        task = self._task
        # Cancel until it ends: grpc.aio can swallow a cancellation that lands inside a call
        # (the call ends CANCELLED, the task runs on), and the loop would then wait forever.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        await self._disconnect()
        await self._close_channel()

    async def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()


PeerFactory = Callable[[str, "str | None"], PrefillPeer]


class PrefillPeers:
    """Every prefill engine known (decode_svc/discovery.py adds and retires them); `pick()` takes
    the least loaded ready one."""

    def __init__(self, peers: list[PrefillPeer], factory: PeerFactory | None = None, *, configured: bool = True) -> None:
        self.peers = peers
        self.configured = configured  # False: no --prefill given (only P/D decode legs are served)
        self.factory = factory
        self.retiring: list[PrefillPeer] = []
        self._next = 0
        self._started = False
        self._retirements: set[asyncio.Task[None]] = set()

    def targets(self) -> set[str]:
        """Known addresses, retiring ones too: an address that comes back while its old peer still
        drains is added again only once that peer is closed (both would use the same remote agent
        names, and closing the old link removes them)."""
        return {p.target for p in [*self.peers, *self.retiring]}

    def add(self, target: str, server_name: str | None = None) -> None:
        assert self.factory is not None, "PrefillPeers built without a factory cannot add peers"
        peer = self.factory(target, server_name)
        self.peers.append(peer)
        if self._started:
            peer.start()

    def retire(self, target: str) -> None:
        """Take the peer out of `pick()` at once; it closes once its requests are done."""
        for peer in [p for p in self.peers if p.target == target]:  # a retiring one: nothing more to do
            self.peers.remove(peer)
            self.retiring.append(peer)
            task = asyncio.ensure_future(peer.retire())
            self._retirements.add(task)
            task.add_done_callback(functools.partial(self._retired, peer=peer))

    def _retired(self, task: asyncio.Task[None], *, peer: PrefillPeer) -> None:
        self._retirements.discard(task)
        if peer in self.retiring:
            self.retiring.remove(peer)
        peer.on_state_change()

    def pick(self) -> PrefillPeer:
        """The least loaded ready peer (decode_svc/prefill_load.py: fewest jobs, this engine's and
        the others' as reported, then the smallest share of its cache pinned); ties go
        round-robin, so an idle pool alternates."""
        best = self.pick_other(())
        if best is not None:
            return best
        if not self.configured:
            raise FailedPrecondition(
                "this decode engine has no prefill engine of its own (started without --prefill): it serves only "
                "the decode leg of a P/D router, a request whose kv_transfer_params name the prefill engine "
                '("do_remote_prefill": true); start it with --prefill HOST:PORT to serve plain requests',
                field="kv_transfer_params",
                reason="NO_PREFILL_PEER",
            )
        states = "; ".join(
            f"{p.target}: {dpb.PeerState.Name(p.state).removeprefix('PEER_STATE_').lower()}"  # type: ignore[arg-type]
            + (f" ({p.last_error})" if p.last_error else "")
            for p in self.peers
        )
        raise Unavailable(f"no prefill engine is ready ({states})", reason="NO_PREFILL_PEER")

    def pick_other(self, tried: Collection[PrefillPeer]) -> PrefillPeer | None:
        """As `pick()`, among the ready peers not in `tried`; None when there is none."""
        n = len(self.peers)
        best: PrefillPeer | None = None
        best_load: PeerLoad | None = None  # taken once a second candidate needs comparing: one alone is not ranked
        best_at = 0
        for i in range(n):
            at = (self._next + i) % n
            peer = self.peers[at]
            if not peer.ready or peer in tried:
                continue
            if best is None:
                best, best_at = peer, at
                continue
            if best_load is None:
                best_load = best.load
            load = peer.load
            if load < best_load:
                best, best_load, best_at = peer, load, at
        if best is not None:
            self._next = (best_at + 1) % n
        return best

    def known_links(self) -> list[PeerLink]:
        """The last link of every peer that was ever READY, whether or not it is ready now (a lost
        session's link is closed: only its layout is read): the prefill engines whose chains
        decode's caches may hold state under. Retiring peers are gone from DNS: not theirs."""
        return [p.last_link for p in self.peers if p.last_link is not None]

    @property
    def any_ready(self) -> bool:
        return any(p.ready for p in self.peers)

    @property
    def remote_agents(self) -> int:
        """Remote agents loaded for all peers, retiring ones too (0 for a peer whose link was dropped)."""
        return sum(len(p.link.added) for p in [*self.peers, *self.retiring] if p.link is not None and not p.link.closed)

    def start(self) -> None:
        self._started = True
        for peer in self.peers:
            peer.start()

    async def aclose(self) -> None:
        for task in list(self._retirements):
            task.cancel()
        await asyncio.gather(*self._retirements, return_exceptions=True)
        await asyncio.gather(*(p.aclose() for p in [*self.peers, *self.retiring]))
