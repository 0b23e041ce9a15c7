"""One Generate request, end to end on the decode side: the request's path.

validate (decode_svc/request.py) -> pick a ready prefill peer (the least loaded) -> look the
prompt up in decode's own caches (decode_svc/reuse.py; with no peer ready, a state checkpoint of
the prompt lets the request go on without one, `_source`) -> allocate local blocks (the prompt
and the first step; queued while the cache is full) -> job on the peer's Session stream -> manifest
-> one READ per (decode rank, prefill rank) -> [check the state: digests, and the recompute with
--check-state, decode_svc/read_checks.py] -> the request joins the engine's step loop
(shared/runtime/step_loop.py: one step computes the next token of every running request), the
blocks grown as the sequence crosses block boundaries (decode_svc/growing_blocks.py) -> token
chunks (a token each, or N with --stream-interval N: `ClientStream`), then a summary
(decode_svc/responses.py).

At the full-N boundary (--boundary full) prefill samples the first output token and sends it
ahead of its manifest, the moment it is drawn (decode_svc/early_token.py): it goes to the client
at once, before prefill's digests, pin and manifest, and the transfer hides behind it; decoding
continues by feeding it. (A prefill that does not send it early: it comes with the manifest and
goes out as soon as the READ is posted.) A first token that ends the request (a stop token, or
max_tokens 1) needs no state at all: nothing is READ, and the job is cancelled (or, when its
manifest came first, prefill's pin released) at once, the summary not waiting for the manifest.

Pipelined transfer (--manifest-parts, with a chunking prefill): each manifest part but the last
is READ and its digests checked as it arrives (decode_svc/part_reads.py); the last answers the
job. Decode-side reuse (decode_svc/reuse.py `DecodeReuse`, wiring the request to the prefix
cache, --prefix-cache-blocks, and the state checkpoints, --prefix-cache-states): a prefix cache
hit's blocks lead the request's and every READ moves only K/V after them (`read_blocks` settles,
at the first manifest, which blocks the READs write); a request whose computed prompt is exactly
one a finished request READ restores that state and decodes with no job and no READ
(`decode_restored`), so it needs no ready prefill engine either: it then looks the checkpoint up
under the chains of the prefill engines decode linked with before (`PrefillPeers.known_links`;
the key is unchanged, so only bytes of an engine that computes them identically are used). With
none held, or a restore that fails its digests and so needs the job after all, it fails
UNAVAILABLE like any request while no prefill engine is ready. A checkpoint is taken after each
READ's digest check (`keep_state`), and a finished request's prompt blocks enter the prefix cache
(`keep_prefix`).

The decode leg of vLLM's P/D protocol (`kv_transfer_params` with `do_remote_prefill`) differs
only in where the state comes from: the prefill engine the params name (handshaken on first
sight, decode_svc/learned_peers.py) and a `claim` of the request it pinned instead of a job.

Deadlines: the client's deadline (or decode_svc/request.py's DEFAULT_TIMEOUT_SECONDS) bounds
everything and travels to prefill with the job; waits for capacity end a little earlier so
RESOURCE_EXHAUSTED reaches the client; each READ also has its own deadline
(--read-timeout-seconds), because a frozen prefill leaves a READ in flight forever. A cancelled
or expired call cancels the job on prefill, or releases its READ handles and then its blocks.

Every failure leaves both sides' blocks free: local blocks in `finally`, once the last model
call of the request ended and every READ handle of the request is released (a READ that timed
out may still be landing until then); prefill's through the READ notifications, an explicit
release sent once those handles are released, or its lease (a decode leg that fails before its
claim gives the pin up at once where the prefill engine is reachable). If the prefill session is
lost while a request reads, that request fails at once with UNAVAILABLE naming the peer;
requests past their READ carry on. A job the chosen prefill fails before its manifest (session
lost, draining, no capacity) goes to another ready prefill engine (decode_svc/prefill_retry.py);
a P/D decode leg never moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from decode_svc.early_token import EarlyToken
from decode_svc.forks import fork_blocks, fork_key, fork_sampling, fork_seeds, merged
from decode_svc.growing_blocks import GrowingBlocks, admission_tokens
from decode_svc.learned_peers import LearnedPeers, check_claimed
from decode_svc.local_prefill import LocalPrefill, LocalPrefillMode, Reason
from decode_svc.part_reads import PartReads
from decode_svc.peer_link import PeerLink
from decode_svc.prefill_peer import PrefillPeer, PrefillPeers
from decode_svc.prefill_retry import on_some_prefill
from decode_svc.prefix_cache import Hit
from decode_svc.read_checks import StateChecks
from decode_svc.reader import ReadStats, read_request, transfer_attributes
from decode_svc.request import RequestContext, check_fits_prefill
from decode_svc.responses import ClientStream, Transfer, client_stream, prompt_response, summary
from decode_svc.reuse import NO_FORKS, DecodeReuse, ForkFirsts, ReadTarget, Reused, Steps
from decode_svc.session_client import SessionClient
from shared.cache.manifest import Manifest
from shared.config import DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS, DEFAULT_MAX_BATCHED_TOKENS, DEFAULT_READ_TIMEOUT_SECONDS
from shared.engine.logprobs import TokenLogprobs
from shared.engine.protocol import RequestBlocks
from shared.engine.timed import timed
from shared.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    Internal,
    ServiceError,
    Unavailable,
)
from shared.observe import Count, Observer, Stage
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc.deadlines import wait_deadline
from shared.rpc.logprobs_message import checked_first
from shared.runtime import faults
from shared.runtime.engine_host import EngineHost
from shared.runtime.step_loop import StepLoop
from shared.telemetry import Telemetry
from shared.transport.read_fence import ReadFence

log = logging.getLogger(__name__)
T = TypeVar("T")


def first_token_of(manifest: Manifest, host: EngineHost, peer: str) -> int | None:
    """The manifest's first token, which the full-N boundary needs and the n-1 boundary must not
    have (the handshake made both engines state the same boundary: a mismatch is a peer bug)."""
    full = host.engine.boundary == "full"
    if full == (manifest.first_token is not None):
        return manifest.first_token
    said = "no first token" if full else f"first token {manifest.first_token}"
    raise Internal(
        f"prefill {peer} sent a manifest with {said}; this decode engine runs the {host.engine.boundary} boundary",
        field="manifest.first_token_id",
        reason="BAD_MANIFEST",
    )


class ComputeGuard:
    """Model calls of one request, on the compute thread. A cancelled request's call still runs
    to its end, so the request's blocks are freed only after the last call finished, and only
    once every READ into them is released (`reads`)."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self._last: asyncio.Future[Any] | None = None

    def after(self, call: asyncio.Future[Any] | None) -> None:
        """A model call that reads the request's blocks and was queued elsewhere (a step of the
        step loop): freeing waits for it too, unless a later call of the request was awaited."""
        if call is None or call.done():
            return
        last = self._last
        self._last = call if last is None or last.done() else asyncio.gather(last, call, return_exceptions=True)

    async def run(self, fn: Callable[[], T]) -> T:
        task: asyncio.Future[T] = asyncio.ensure_future(self.host.run_compute(fn))
        self._last = task
        return await asyncio.shield(task)

    def free_when_idle(self, key: str, reads: ReadFence | None = None, hit: Hit | None = None) -> None:
        def free() -> None:
            if reads is None:
                self.host.free(key)
            else:
                reads.when_released(lambda: self.host.free(key))
            if hit is not None:  # the prefix cache's blocks: no model call reads them any more
                hit.release()

        last = self._last
        if last is None or last.done():
            free()
        else:
            last.add_done_callback(lambda _: free())


@dataclass
class Admitted:
    """Where an admitted request's state comes from and the blocks it holds: a prefill peer
    (for a P/D decode leg, the one its params name), what decode's caches hold for the prompt,
    or decode's own engine (`here`: why)."""

    peer: PrefillPeer | None
    reused: Reused
    here: Reason | None
    local: RequestBlocks
    remote_leg: bool = False


@dataclass
class RequestIo:
    """A request's model calls, READ handles and manifest parts, and the blocks its READs write:
    what freeing its blocks waits for."""

    compute: ComputeGuard
    reads: ReadFence
    parts: PartReads
    target: ReadTarget


@dataclass
class Outcome:
    ended: bool = False  # the stage served the request to its end


@dataclass
class Moved:
    """What the transfer stage leaves for decoding: the READ state (None: the first token ended
    the request), the blocks it is in, the first token (full-N) and the client stream."""

    transfer: Transfer | None = None
    local: RequestBlocks | None = None
    first: int | None = None
    out: ClientStream | None = None


class Generation:
    def __init__(
        self,
        host: EngineHost,
        peers: PrefillPeers,
        *,
        check_state: bool,
        read_timeout: float = DEFAULT_READ_TIMEOUT_SECONDS,
        manifest_parts: bool = True,
        telemetry: Telemetry | None = None,
        learned: LearnedPeers | None = None,
        prefix_cache_blocks: int = 0,
        prefix_cache_states: int = 0,
        local_prefill: LocalPrefillMode = "fallback",
        local_prefill_below: int = 0,
        local_prefill_queue_tokens: int = DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS,
        max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
    ) -> None:
        self.host = host
        self.peers = peers
        self.learned = learned or LearnedPeers(peers, lambda target: PrefillPeer(target, host, None, once=True))
        self.check_state = check_state
        self.read_timeout = read_timeout
        self.manifest_parts = manifest_parts  # --manifest-parts: jobs accept manifest parts
        self.telemetry = telemetry
        self._active: set[str] = set()
        self.observer = observer = Observer() if telemetry is None else Observer(telemetry)
        self.checks = StateChecks(host, check_state, observer)
        self.reuse = DecodeReuse(host, self.checks, prefix_cache_blocks, prefix_cache_states, observer)
        self.step_loop = StepLoop(host.engine, host.submit_compute)
        self.step_loop.observer = observer
        self.local = LocalPrefill(
            host, self.checks, local_prefill, local_prefill_below, observer, max_batched_tokens, local_prefill_queue_tokens
        )

    async def aclose(self) -> None:
        """Stop the local prefill steps (service shutdown, once no request is in flight)."""
        await self.local.aclose()

    @property
    def in_flight(self) -> int:
        return len(self._active)

    async def run(self, req: RequestContext) -> AsyncIterator[pb.GenerateResponse]:
        # The blocks' holders: the request's id and its forks' (`<id>#<i>`), none of them another request's.
        keys = {req.request_id, *(fork_key(req.request_id, i) for i in range(1, req.n))}
        if keys & self._active:
            raise AlreadyExists(f"{req.request_id!r} is already in flight on this decode engine", field="request_id")
        self._active |= keys
        try:
            async for response in self._run(req):
                yield response
        finally:
            self._active -= keys
            self.local.done(req.request_id)  # ended before its prompt was computed here

    async def _run(self, req: RequestContext) -> AsyncIterator[pb.GenerateResponse]:
        """The request's stages: admit (where its state comes from, its blocks), then one of
        restore (a state checkpoint), compute here (decode's own prefill) or transfer (a job or a
        claim, the READ), then decode (join the step loop, stream, finish). Each stage that ends
        the request returns through its own responses; the blocks are freed once no model call
        or READ uses them."""
        adm = await self._admit(req)
        io = RequestIo(ComputeGuard(self.host), ReadFence(), PartReads(), ReadTarget(adm.local))
        try:
            if adm.reused.state is not None:
                restored = Outcome()
                async with closing(self._restore(req, adm, io, restored)) as stage:
                    async for response in stage:
                        yield response
                if restored.ended:
                    return
            self._repick(req, adm)
            if adm.here is not None:
                steps: Steps = lambda n, out, first, forks: self._steps(req, n, adm.local, io.compute, out, first, forks)  # noqa: E731
                async with closing(self.local.run(req, adm.local, io.compute.run, steps, adm.here)) as stage:
                    async for response in stage:
                        yield response
                return
            moved = Moved()
            async with closing(self._transfer(req, adm, io, moved)) as stage:
                async for response in stage:
                    yield response
            if moved.transfer is None:  # the first token ended the request: no state was needed
                return
            assert moved.out is not None and moved.local is not None
            decoding = self._decode(req, moved.transfer, moved.local, io.compute, moved.out, moved.first, adm.reused)
            async with closing(decoding) as stage:
                async for response in stage:
                    yield response
        finally:
            if adm.peer is not None:
                adm.peer.unroute(req.request_id)
            io.compute.free_when_idle(req.request_id, io.reads, adm.reused.hit)
            self.reuse.release_state(adm.reused)

    async def _admit(self, req: RequestContext) -> Admitted:
        """Where the request's state comes from (a prefill peer, a state checkpoint, decode's own
        engine; for a P/D decode leg the prefill engine its params name), and its local blocks
        (the prompt and the first step; queued while the cache is full)."""
        loop = asyncio.get_running_loop()
        admit = admission_tokens(len(req.prompt))
        if req.remote is None:
            peer, reused, here = self._source(req)
            try:
                leading = self.reuse.leading(reused)
                local = await self.host.allocate_queued(
                    req.request_id, admit, wait_deadline(req.deadline, loop.time()), leading=leading
                )
            except BaseException:
                self.reuse.release(reused)
                if peer is not None:
                    peer.unroute(req.request_id)
                raise
            return Admitted(peer, reused, here, local)
        try:
            named = await self.learned.peer_for(req.remote)  # the named engine, params checked against it
            local = await self.host.allocate_queued(req.request_id, admit, wait_deadline(req.deadline, loop.time()))
        except BaseException as e:
            # Prefill pinned the state for whoever claims it: free it now, not at its lease's end.
            self.learned.give_up(req.remote, f"decode leg failed before its claim: {type(e).__name__}")
            raise
        return Admitted(named, Reused(), None, local, remote_leg=True)

    async def _restore(
        self, req: RequestContext, adm: Admitted, io: RequestIo, restored: Outcome
    ) -> AsyncIterator[pb.GenerateResponse]:
        """A state checkpoint of the prompt: its first token alone may end the request, else its
        state restored into the request's blocks is decoded on (`restored.ended` either way). A
        restore that fails its digests leaves the request to the other stages."""
        reused = adm.reused
        state = reused.state
        assert state is not None
        ended = None if state.first_token is None else req.stop.finish(state.first_token, 1)
        if ended is not None:  # the stored first token ends the request: no state is needed
            self._count_without_prefill(adm.peer)
            for only in self.reuse.first_token_only(req, reused, ended):
                yield only
            restored.ended = True
            return
        if not await self.reuse.restored(io.compute.run, reused, adm.local):
            return
        self._count_without_prefill(adm.peer)
        restored.ended = True
        local, compute = adm.local, io.compute
        from_state = self.reuse.decode_restored(
            req,
            reused,
            local,
            compute.run,
            lambda n, out, first, forks: self._steps(req, n, local, compute, out, first, forks),
        )
        async with closing(from_state) as stage:
            async for response in stage:
                yield response

    def _repick(self, req: RequestContext, adm: Admitted) -> None:
        """The peer the request was admitted with may have been lost while it waited for blocks
        (or none was ready): a plain request takes another, or decode's own engine; a decode leg
        fails UNAVAILABLE."""
        if adm.here is not None:
            return
        if adm.remote_leg:
            assert adm.peer is not None
            if not adm.peer.ready:
                raise Unavailable(
                    f"prefill {adm.peer.name} was lost while this request waited for blocks", reason="PEER_UNAVAILABLE"
                )
        elif adm.peer is None or not adm.peer.ready:
            if adm.peer is not None:
                adm.peer.unroute(req.request_id)
            adm.peer, adm.here = self._pick_or_here(req, adm.reused)
            if adm.peer is not None:
                self._route(adm.peer, req, adm.reused)

    async def _transfer(
        self, req: RequestContext, adm: Admitted, io: RequestIo, moved: Moved
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The state from prefill: a job on the peer's Session stream (the first token streamed
        the moment prefill draws it, at full-N) or the claim of a decode leg, then the READ. On
        return `moved.transfer` is set, or None when the first token ended the request (then the
        summary went out already)."""
        peer = adm.peer
        assert peer is not None
        key, reused = req.request_id, adm.reused
        compute, reads, parts, target = io.compute, io.reads, io.parts, io.target
        job_sent = time.monotonic()
        out = client_stream(self.host, req, self.observer)
        moved.out = out
        # The first token early, unless the prompt's logprobs must go out before it (they come
        # with the manifest), or other sequences' first tokens come with it (in the manifest).
        alone = req.prompt_logprobs is None and req.n == 1
        early = EarlyToken() if not adm.remote_leg and self.host.engine.boundary == "full" and alone else None
        if not adm.remote_leg:  # another prefill engine takes the job if this one fails it before its manifest
            attempt = functools.partial(self._submit, req, reused, target, compute, reads, parts, early)
            job = asyncio.ensure_future(
                on_some_prefill(self.peers, peer, attempt, req.deadline, self._count_retry, retryable=lambda: not parts.any)
            )
            try:
                token = None if early is None else await early.first(job)
                if token is not None:  # prefill drew it ahead of its manifest: it goes out at once
                    assert early is not None
                    yield out.chunk([token], checked_first(early.logprobs, token, req.logprobs, "first_token.logprobs"))
                    ended = req.stop.finish(token, 1)
                    if ended is not None and not job.done():  # no state is needed, so no manifest either
                        assert early.link is not None
                        await self._stop_job(job, parts, reads, key, "the first token ended the request")
                        taken = early.seconds_after(job_sent)
                        transfer = Transfer(early.link, None, ReadStats(), taken, engine_seconds=early.engine_seconds)
                        for response in (
                            out.tail(),
                            summary(req, out, ended, transfer, self.checks, transferred=0, read=False),
                        ):
                            if response is not None:
                                yield response
                        return
                session, link, manifest = await job
            except BaseException as e:
                await self._stop_job(job, parts, reads, key, f"read not completed: {type(e).__name__}")
                raise
        else:
            remote = req.remote
            assert remote is not None and peer.session is not None and peer.link is not None and remote.transfer_id is not None
            session, link = peer.session, peer.link
            manifest = await session.claim(remote.request_id, remote.transfer_id)
        prefill_seconds = time.monotonic() - job_sent
        pinned_as = manifest.request_id  # prefill's name for the pin (the prefill leg's id for a claim)
        sent_early = early is not None and early.sent
        try:
            if adm.remote_leg:
                assert req.remote is not None
                computed = self.host.engine.num_prefill_tokens(len(req.prompt))
                check_claimed(req.remote, manifest, len(req.prompt), computed, req.prompt_field)
            local = self.reuse.read_blocks(manifest, reused, target, link.engine_id)
            moved.local = local
            first = first_token_of(manifest, self.host, link.engine_id)
            if early is not None:
                early.check(first, link.engine_id)
            if req.prompt_logprobs is not None:  # before any token: the first is not sent early then
                yield prompt_response(manifest.prompt_logprobs, req.prompt, req.prompt_logprobs, "manifest.prompt_logprobs")
            first_logprobs = None
            if first is not None and not sent_early:
                first_logprobs = checked_first(manifest.first_logprobs, first, req.logprobs, "manifest.first_token_logprobs")
            # A first token that ends the request needs no state; with several sequences the others do.
            ended = None if first is None or req.n > 1 else req.stop.finish(first, 1)
            if ended is None:
                read = _unless_session_ends(session, self._read_all(link, manifest, local, req.deadline, reads, parts))
                if first is None or sent_early:  # nothing to send meanwhile: no task of its own for the READ
                    stats = await read
                else:
                    reading = asyncio.ensure_future(read)
                    try:
                        yield out.chunk([first], first_logprobs)  # while the READ runs: the transfer hides behind it
                        stats = await reading
                    finally:
                        if not reading.done():  # the client went away during the first chunk
                            reading.cancel()
                            await asyncio.gather(reading, return_exceptions=True)
        except BaseException as e:
            # Prefill may reuse its blocks once no READ of ours can still be reading them.
            await parts.cancel()
            reason = f"read not completed: {type(e).__name__}"
            reads.when_released(lambda: session.release(pinned_as, reason))
            raise
        if ended is not None:
            assert first is not None
            # The first token ended the request: the state is never needed, so never READ (the
            # READs of parts already started are stopped; prefill frees once they are released).
            await parts.cancel()
            reads.when_released(lambda: session.release(pinned_as, "the first token ended the request"))
            for response in (None if sent_early else out.chunk([first], first_logprobs), out.tail()):
                if response is not None:
                    yield response
            transfer = Transfer(link, manifest, ReadStats(), prefill_seconds)
            yield summary(req, out, ended, transfer, self.checks, transferred=0, read=False)
            return
        session.done_reading(pinned_as)
        self._count_read(stats)
        moved.first = first
        moved.transfer = Transfer(link, manifest, stats, prefill_seconds)

    def _source(self, req: RequestContext) -> tuple[PrefillPeer | None, Reused, Reason | None]:
        """Where a plain request's state comes from: decode's own engine for a prompt below
        --local-prefill-below; else the least loaded ready prefill peer, with what decode's
        caches hold for the prompt under its chain (or, with --local-prefill share while that
        peer is busy and the caches hold nothing, decode's own engine); with none ready, a state
        checkpoint of the prompt under the chain of a prefill engine linked before (no peer: it
        needs none unless its restore fails), else decode's own engine (--local-prefill fallback),
        else `pick`'s UNAVAILABLE naming every peer."""
        if self.local.short(len(req.prompt)):
            return self._here(req, "short_prompt")
        try:
            peer = self.peers.pick()  # fails fast (UNAVAILABLE) when no prefill is ready
        except (Unavailable, FailedPrecondition):
            link = self.reuse.restorable(self.peers.known_links(), req)
            if link is not None:
                return None, self.reuse.lookup(link, req), None
            if not self.local.falls_back:
                raise
            return self._here(req, "no_prefill_ready")
        assert peer.link is not None
        check_fits_prefill(self.host, peer.link, req)
        reused = self.reuse.lookup(peer.link, req)
        if not reused.hit.entries and reused.state is None and self.local.shares(peer.link, peer.queued_tokens):
            self.reuse.release(reused)
            return self._here(req, "prefill_busy")
        self._route(peer, req, reused)
        return peer, reused, None

    def _route(self, peer: PrefillPeer, req: RequestContext, reused: Reused) -> None:
        """The request goes to `peer`: its job counts in the peer's load from now on."""
        assert peer.link is not None
        peer.route(req.request_id, len(req.prompt) - self.reuse.announced(reused, peer.link))

    def _here(self, req: RequestContext, reason: Reason) -> tuple[None, Reused, Reason]:
        """Decode's own engine computes the prompt (counted by `share` until it has)."""
        self.local.claim(req.request_id, len(req.prompt))
        return None, Reused(), reason

    def _pick_or_here(self, req: RequestContext, reused: Reused) -> tuple[PrefillPeer | None, Reason | None]:
        """A ready peer for a request whose own one was lost (or a checkpoint that failed to
        restore); with none ready, decode's own engine where it may fall back and the request's
        blocks hold no prefix cache blocks (which a local prefill would write over)."""
        try:
            return self.peers.pick(), None
        except (Unavailable, FailedPrecondition):
            if not self.local.falls_back or reused.hit.entries:
                raise
            self.local.claim(req.request_id, len(req.prompt))
            return None, "no_prefill_ready"

    async def _submit(
        self,
        req: RequestContext,
        reused: Reused,
        target: ReadTarget,
        compute: ComputeGuard,
        reads: ReadFence,
        parts: PartReads,
        early: EarlyToken | None,
        peer: PrefillPeer,
    ) -> tuple[SessionClient, PeerLink, Manifest]:
        """The request's job on `peer`: the session and link it went through, and its (last)
        manifest; with --manifest-parts each earlier part is READ as it arrives (`parts`), and at
        the full-N boundary the first token is taken ahead of the manifest (`early`). The prefix
        cache's tokens are announced only to a prefill engine that writes the same K/V."""
        session, link = peer.session, peer.link
        if session is None or link is None:
            raise Unavailable(f"prefill {peer.name} was lost before the job was sent", reason="PEER_UNAVAILABLE")
        check_fits_prefill(self.host, link, req)
        now = asyncio.get_running_loop().time()
        cached = self.reuse.announced(reused, link)

        def on_part(part: Manifest) -> None:
            parts.source = session
            try:  # before its READ: a part must never land in the prefix cache's shared blocks
                blocks = self.reuse.read_blocks(part, reused, target, link.engine_id)
            except ServiceError as e:
                parts.arrived(part, _raise(e))  # fails the request where the parts' READs are gathered
                return
            parts.arrived(part, self._read_part(req, link, part, blocks, compute, reads))

        parts.on_failure = functools.partial(session.fail_waiting, req.request_id)  # a failed part ends the wait
        peer.unroute(req.request_id)  # the session counts the job from here on (submit registers it at once)
        manifest = await session.submit(
            req.request_id,
            req.prompt,
            wait_deadline(req.deadline, now) - now,
            req.sampling,
            on_part=on_part if self.manifest_parts else None,
            cached_tokens=cached,
            on_first_token=None if early is None else functools.partial(early.take, link),
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            fork_seeds=fork_seeds(req.sampling, req.n),
        )
        return session, link, manifest

    async def _read_part(
        self, req: RequestContext, link: PeerLink, part: Manifest, local: RequestBlocks, compute: ComputeGuard, reads: ReadFence
    ) -> ReadStats:
        """One part before the last: its READ, then its digests, while prefill computes on."""
        stats = await self._read(link, part, local, req.deadline, reads)
        if self.host.verify_transfer:
            await self.checks.digests(compute.run, req.request_id, part, link, local)
        return stats

    async def _read_all(
        self, link: PeerLink, manifest: Manifest, local: RequestBlocks, deadline: float, reads: ReadFence, parts: PartReads
    ) -> ReadStats:
        """The last (or only) manifest's READ, and the earlier parts' READs finishing meanwhile.
        `seconds`: from the last manifest to every READ done (the READ time left exposed)."""
        started = time.monotonic()
        try:
            parts.check_chain(manifest, link.engine_id, link.plan.prefill.spec.num_layers)
            stats = await self._read(link, manifest, local, deadline, reads)
            stats.add(await parts.gather())
        except BaseException:
            await parts.cancel()
            raise
        stats.seconds = time.monotonic() - started
        return stats

    async def _stop_job(
        self,
        job: asyncio.Future[tuple[SessionClient, PeerLink, Manifest]],
        parts: PartReads,
        reads: ReadFence,
        key: str,
        reason: str,
    ) -> None:
        """The request no longer needs its job: one still running is cancelled on its prefill (the
        session sends the cancel); once parts or a manifest arrived, READs of them are stopped
        and prefill is told to free the request when no READ of it can land any more."""
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
        source, pinned_as = parts.source, key
        if not job.cancelled() and job.exception() is None:  # the manifest came meanwhile: its pin is ours to end
            session, _, manifest = job.result()
            source, pinned_as = session, manifest.request_id
        if source is not None:
            await parts.cancel()
            reads.when_released(functools.partial(source.release, pinned_as, reason))

    def _count_without_prefill(self, peer: PrefillPeer | None) -> None:
        """A state checkpoint serves the request and no prefill engine was ready to (`_source`)."""
        if peer is None:
            self.observer.count(Count.PREFIX_STATE_WITHOUT_PREFILL)

    def _count_retry(self, reason: str) -> None:
        self.observer.count(Count.PREFILL_RETRY, kind=reason)

    async def _read(
        self, link: PeerLink, manifest: Manifest, local: RequestBlocks, deadline: float, reads: ReadFence
    ) -> ReadStats:
        """The manifest's state into `local`: refused if the lease already ran out; one deadline
        per READ. Decode's heartbeats keep renewing the lease meanwhile."""
        if manifest.lease_ns <= 0:
            raise Aborted(
                f"prefill {link.engine_id} sent a manifest whose lease already expired; its blocks may be reused",
                field="manifest.lease_duration",
                reason="LEASE_EXPIRED",
            )
        await faults.pause("before_read", manifest.request_id)
        timeout = min(self.read_timeout, deadline - asyncio.get_running_loop().time())
        async with link.reading():
            return await read_request(self.host, link, manifest, local, timeout=timeout, fence=reads)

    async def _decode(
        self,
        req: RequestContext,
        transfer: Transfer,
        local: RequestBlocks,
        compute: ComputeGuard,
        out: ClientStream,
        first_token: int | None,
        reused: Reused,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Decode steps from the READ state (after `first_token`, already sent, at the full-N
        boundary), streamed to the client, then the summary."""
        link, manifest = transfer.link, transfer.manifest
        assert manifest is not None
        await faults.pause("after_read", req.request_id)
        num_computed = manifest.num_computed_tokens
        digest_check_seconds = 0.0
        if self.host.verify_transfer:
            checking = time.monotonic()
            await self.checks.digests(compute.run, req.request_id, manifest, link, local)
            await self.reuse.verify(compute.run, req, reused, local)
            digest_check_seconds = time.monotonic() - checking
        if self.check_state:
            await self.checks.recompute(compute.run, req.prompt, num_computed, local, link)
        await self.reuse.keep_state(compute.run, req, transfer, local, reused, first_token)
        forks = (manifest.fork_first_tokens, manifest.fork_first_logprobs)
        async for chunk in self._steps(req, num_computed, local, compute, out, first_token, forks):
            yield chunk
        await self.reuse.keep_prefix(compute.run, req, reused, local, link, num_computed, manifest.skipped_tokens)
        tail = out.tail()
        if tail is not None:
            yield tail
        assert out.finish is not None
        yield summary(
            req, out, out.finish, transfer, self.checks, transferred=num_computed, digest_check_seconds=digest_check_seconds
        )

    async def _steps(
        self,
        req: RequestContext,
        num_computed: int,
        local: RequestBlocks,
        compute: ComputeGuard,
        out: ClientStream,
        first_token: int | None,
        forks: ForkFirsts = NO_FORKS,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Decode steps from the state in `local` until the request finishes (`out.finish`); a
        request of several sequences forks first (`_forked`). A failure first sends every
        sequence's tokens held for its stream interval's chunk: an error holds none back."""
        try:
            if req.n == 1:
                async for chunk in self._sequence(req, num_computed, local, compute, out, first_token):
                    yield chunk
                return
            async for chunk in self._forked(req, num_computed, local, compute, out, first_token, forks):
                yield chunk
        except Exception:
            for stream in (out, *out.forks):
                held = stream.flush()
                if held is not None:
                    yield held
            raise

    async def _forked(
        self,
        req: RequestContext,
        num_computed: int,
        local: RequestBlocks,
        compute: ComputeGuard,
        out: ClientStream,
        first_token: int | None,
        forks: ForkFirsts,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's n sequences from the one state in `local` (decode_svc/forks.py), their
        chunks as they come, each tagged with its index; sequence 0 streams through `out`, the
        others through streams of their own (`out.forks`, for the summary). At full-N the first
        tokens are prefill's: `first_token` (sent already) and one per fork in `forks`."""
        tokens, logprobs = forks
        if first_token is not None and len(tokens) != req.n - 1:
            raise Internal(
                f"prefill drew {len(tokens)} first tokens for the other sequences of a request of {req.n}",
                field="manifest.fork_first_token_ids",
            )
        if first_token is not None:
            out.finish = req.stop.finish(first_token, 1)
        blocks = await fork_blocks(
            self.host, req.request_id, local, len(req.prompt), num_computed, req.n, req.deadline, compute.run
        )
        try:
            out.forks = [client_stream(self.host, req, None, index=i) for i in range(1, req.n)]
            streams = [] if out.finish is not None else [self._sequence(req, num_computed, local, compute, out, first_token)]
            for i, (fork_out, fork_local) in enumerate(zip(out.forks, blocks, strict=True), start=1):
                fork_req = dataclasses.replace(req, sampling=fork_sampling(req.sampling, i))
                first = tokens[i - 1] if first_token is not None else None
                lp = logprobs[i - 1] if first is not None and i <= len(logprobs) else None
                streams.append(self._fork(fork_req, num_computed, fork_local, compute, fork_out, first, lp))
            async for chunk in merged(streams):
                yield chunk
        finally:
            for i in range(1, req.n):
                compute.free_when_idle(fork_key(req.request_id, i))

    async def _fork(
        self,
        req: RequestContext,
        num_computed: int,
        local: RequestBlocks,
        compute: ComputeGuard,
        out: ClientStream,
        first_token: int | None,
        first_logprobs: TokenLogprobs | None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One forked sequence: its first token (full-N), its steps, its held-back text."""
        if first_token is not None:
            lps = checked_first(first_logprobs, first_token, req.logprobs, "manifest.fork_first_token_logprobs")
            yield out.chunk([first_token], lps)
            out.finish = req.stop.finish(first_token, 1)
        if out.finish is None:
            async for chunk in self._sequence(req, num_computed, local, compute, out, first_token):
                yield chunk
        tail = out.tail()
        if tail is not None:
            yield tail

    async def _sequence(
        self,
        req: RequestContext,
        num_computed: int,
        local: RequestBlocks,
        compute: ComputeGuard,
        out: ClientStream,
        first_token: int | None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Decode steps of one sequence from the state in `local` until it finishes
        (`out.finish`): it joins the engine's step loop and streams each token as its step ends."""
        blocks = GrowingBlocks(self.host, local, len(req.prompt))
        sampling = req.sampling
        decode, start_seconds = await compute.run(
            lambda: timed(
                lambda: self.host.engine.start_decode(
                    req.prompt, num_computed, local, blocks.ensure, sampling=sampling, first_token=first_token
                )
            )
        )
        member = self.step_loop.join(decode, req.stop, req.deadline, blocks, generated=out.generated, logprobs=req.logprobs)
        try:
            async for token in member.tokens():
                if out.generated == 0:  # the request's first token is decode's own (n-1 boundary)
                    out.first_step_seconds = start_seconds + token.step_seconds
                out.finish = token.finish
                response = out.step(token.token_id, token.logprobs, token.finish)
                if response is not None:  # else held: the stream interval's chunk is not full yet
                    yield response
        finally:
            self.step_loop.leave(member)
            compute.after(member.last_step)  # its blocks stay until a step still running with it ends

    def _count_read(self, stats: ReadStats) -> None:
        if stats.read_count and self.observer.listening():
            self.observer.stage(Stage.TRANSFER, stats.seconds, transfer_attributes(stats))


@contextlib.asynccontextmanager
async def closing(stream: AsyncIterator[T]) -> AsyncIterator[AsyncIterator[T]]:
    """`stream` closed on the way out, before the stage around it goes on: a request that ends
    (its client gone, a failure) runs the inner stage's cleanup first (its READs stopped, its
    step-loop place given up), not whenever the stream is collected."""
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def _raise(error: ServiceError) -> ReadStats:
    raise error


async def _unless_session_ends(session: SessionClient, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, but give up (cancelling it) as soon as the prefill session is lost: a dead or
    frozen prefill fails its in-flight READs within the heartbeat timeout, not the READ deadline."""
    task = asyncio.ensure_future(work)
    lost = asyncio.ensure_future(session.closed.wait())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        lost.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # READ handles released by now
    if task.cancelled():
        raise session.ended_error()
    return task.result()
