"""One Generate request, end to end on the decode side.

validate -> pick a ready prefill peer (the least loaded) -> allocate local blocks (the prompt and
the first step; queued while the cache is full) -> job on the peer's Session stream -> manifest
-> one READ per (decode rank, prefill rank) -> [check the state: digests, and the recompute with
--check-state] -> engine decode steps off the loop, the blocks grown as the sequence crosses
block boundaries (decode_svc/growing_blocks.py) -> token chunks, then a summary.

At the full-N boundary (--boundary full) the manifest brings the first output token, sampled
by prefill: it goes to the client as soon as the READ is posted, before the READ completes (the
transfer hides behind the first token), and decoding continues by feeding it. A first token that
ends the request (a stop token, or max_tokens 1) needs no state at all: nothing is READ and
prefill's pin is released at once.

Pipelined transfer (--manifest-parts, with a chunking prefill): each manifest part but the last
is READ and its digests checked as it arrives (decode_svc/part_reads.py); the last answers the
job. Decode's prefix cache (--prefix-cache-blocks, decode_svc/prefix_cache.py): a hit's blocks
lead the request's, the job says how many prompt tokens they hold, and every READ (each part's,
or the one manifest's) moves only K/V after them. Which blocks the READs write is settled at the
first manifest, part or whole (`_reuse`): if prefill skipped nothing, fresh blocks replace the
hit's before any READ, so no READ ever writes blocks the cache shares. State checkpoints
(--prefix-cache-states, decode_svc/state_checkpoints.py): a request whose computed prompt is
exactly one a finished request READ restores that state into its own blocks and decodes with no
job and no READ (`_decode_restored`); a checkpoint is taken after each READ's digest check. At
full-N it holds the first token prefill drew too, found only by a request that draws it alike
(greedy, or the same seed and sampling): that token goes out first and is fed, as after a
manifest, and one that ends the request needs no state restored.

The decode leg of vLLM's P/D protocol (`kv_transfer_params` with `do_remote_prefill`) differs
only in where the state comes from: the prefill engine the params name (handshaken on first
sight, decode_svc/learned_peers.py) and a `claim` of the request it pinned instead of a job.

Deadlines: the client's deadline (or DEFAULT_TIMEOUT_SECONDS) bounds everything and travels to
prefill with the job; waits for capacity end a little earlier so RESOURCE_EXHAUSTED reaches the
client; each READ also has its own deadline (--read-timeout-seconds), because a frozen prefill
leaves a READ in flight forever. A cancelled or expired call cancels the job on prefill, or
releases its READ handles and then its blocks.

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
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from decode_svc import tokenizer
from decode_svc.growing_blocks import GrowingBlocks, admission_tokens
from decode_svc.learned_peers import LearnedPeers, check_claimed, remote_prefill_of
from decode_svc.part_reads import PartReads
from decode_svc.peer_link import PeerLink
from decode_svc.prefill_peer import PrefillPeer, PrefillPeers
from decode_svc.prefill_retry import on_some_prefill
from decode_svc.prefix_cache import Hit, PrefixCache, chain_of, skipped_bytes
from decode_svc.reader import ReadStats, read_request
from decode_svc.request_options import decode_options, finish_reason_message
from decode_svc.session_client import SessionClient
from decode_svc.state_checkpoints import Checkpoint, StateCheckpoints
from shared.cache.digest import SECTIONS, Section, compare_digests, state_digests
from shared.cache.manifest import Manifest
from shared.config import DEFAULT_READ_TIMEOUT_SECONDS
from shared.engine.protocol import RequestBlocks
from shared.engine.sampling import SamplingParams
from shared.engine.stopping import FinishReason, StopRule, steps
from shared.engine.text import TextStream
from shared.errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ServiceError,
    Unavailable,
)
from shared.http.kv_transfer import RemotePrefill
from shared.otel import spans
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc import fault_hooks
from shared.rpc.deadlines import wait_deadline
from shared.rpc.proto_time import duration, nanoseconds
from shared.runtime.engine_host import EngineHost
from shared.telemetry import Telemetry
from shared.transport.read_fence import ReadFence

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT_SECONDS = 300.0  # when the client set no deadline
MAX_TOKENS_PER_CHUNK = 16


@dataclass(frozen=True)
class RequestContext:
    """One valid Generate request, as the servicer hands it to `Generation.run`."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    prompt_field: str  # the request field the prompt came from, for messages
    deadline: float  # event-loop time: the client's deadline, or DEFAULT_TIMEOUT_SECONDS from arrival
    started: float  # time.monotonic() at arrival
    sampling: SamplingParams  # the seed already picked when the request gave none
    stop: StopRule  # max_tokens, the model's EOS ids (unless ignore_eos) and the request's stop ids
    # The decode leg of vLLM's P/D protocol: the prefill engine and pinned request that
    # kv_transfer_params name (None: this engine picks a prefill peer and sends a job).
    remote: RemotePrefill | None = None


@dataclass
class ReadTarget:
    """The blocks a request's READs write: its own, led by the prefix cache's hit, until a
    manifest says prefill sent the whole state after all (then fresh ones in the hit's place)."""

    blocks: RequestBlocks


@dataclass(frozen=True)
class Transfer:
    """What the request's READ brought: from whom, the manifest it followed, and its cost."""

    link: PeerLink
    manifest: Manifest | None  # None: a state checkpoint, no job and no READ
    stats: ReadStats
    prefill_seconds: float  # job sent -> manifest received


def validate(host: EngineHost, request: pb.GenerateRequest, time_remaining: float | None) -> RequestContext:
    """The request once as a `RequestContext`: every problem names its field; nothing is
    touched before this passes. `time_remaining`: the call's deadline (None: none set)."""
    started = time.monotonic()
    loop_now = asyncio.get_running_loop().time()
    if request.prompt and request.prompt_token_ids:
        raise InvalidArgument("give either prompt or prompt_token_ids, not both", field="prompt")
    prompt = tokenizer.for_engine(host.engine).encode(request.prompt) if request.prompt else list(request.prompt_token_ids)
    prompt_field = "prompt" if request.prompt else "prompt_token_ids"
    if not prompt:
        raise InvalidArgument("the prompt is empty", field="prompt")
    host.check_token_ids(prompt, "prompt_token_ids")
    if request.max_tokens < 1:
        raise InvalidArgument(f"must be >= 1, got {request.max_tokens}", field="max_tokens")
    total = len(prompt) + request.max_tokens
    capacity = host.max_tokens()
    if len(prompt) >= capacity:
        raise InvalidArgument(
            f"{len(prompt)} tokens; this decode engine's cache holds at most {capacity} tokens per request, "
            "prompt and generated tokens together",
            field=prompt_field,
        )
    if total > capacity:
        raise InvalidArgument(
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) = {total} tokens; "
            f"this decode engine's cache holds at most {capacity} tokens per request",
            field="max_tokens",
        )
    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > 128:
        raise InvalidArgument("must be at most 128 characters", field="request_id")
    remote = remote_prefill_of(request.kv_transfer_params)
    deadline = loop_now + (time_remaining if time_remaining is not None else DEFAULT_TIMEOUT_SECONDS)
    options = decode_options(request, host.engine)
    return RequestContext(
        request_id, prompt, request.max_tokens, prompt_field, deadline, started, options.sampling, options.stop, remote
    )


def check_fits_prefill(host: EngineHost, link: PeerLink, req: RequestContext) -> None:
    """A prompt whose prefilled state cannot fit the chosen prefill engine's whole cache."""
    remote = link.remote
    needed = sum(link.plan.prefill.blocks_per_group(host.engine.num_prefill_tokens(len(req.prompt))))
    if needed > remote.num_logical_blocks:
        raise InvalidArgument(
            f"{len(req.prompt)} tokens need {needed} blocks on prefill {remote.engine_id}, whose cache has "
            f"{remote.num_logical_blocks}",
            field=req.prompt_field,
        )


class ClientStream:
    """What the client has been sent: token chunks with their text, and when the first one left."""

    def __init__(self, text: TextStream, started: float, telemetry: Telemetry | None) -> None:
        self._text = text
        self._started = started
        self._telemetry = telemetry
        self.generated = 0
        self.first_token_at: float | None = None
        self.finish: FinishReason | None = None  # set by the step that ends the request

    def chunk(self, ids: list[int]) -> pb.GenerateResponse:
        self.generated += len(ids)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            if self._telemetry is not None:
                self._telemetry.time_to_first_token.observe(self.first_token_at - self._started)
        return pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=ids, text=self._text.feed(ids)))

    def tail(self) -> pb.GenerateResponse | None:
        """The text still held back (an incomplete character), if any."""
        rest = self._text.finish()
        return pb.GenerateResponse(chunk=pb.TokenChunk(text=rest)) if rest else None


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
        self._last: asyncio.Future[object] | None = None

    async def run(self, fn: Callable[[], T]) -> T:
        task: asyncio.Future[T] = asyncio.ensure_future(self.host.run_compute(fn))
        self._last = task  # type: ignore[assignment]
        return await asyncio.shield(task)

    def free_when_idle(self, key: str, reads: ReadFence, hit: Hit | None = None) -> None:
        def free() -> None:
            reads.when_released(lambda: self.host.free(key))
            if hit is not None:  # the prefix cache's blocks: no model call reads them any more
                hit.release()

        last = self._last
        if last is None or last.done():
            free()
        else:
            last.add_done_callback(lambda _: free())


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
    ) -> None:
        self.host = host
        self.peers = peers
        self.learned = learned or LearnedPeers(peers, lambda target: PrefillPeer(target, host, None, once=True))
        self.check_state = check_state
        self.read_timeout = read_timeout
        self.manifest_parts = manifest_parts  # --manifest-parts: jobs accept manifest parts
        self.telemetry = telemetry
        self._active: set[str] = set()
        self.prefix = PrefixCache(host, prefix_cache_blocks, telemetry)
        self.states = StateCheckpoints(host, prefix_cache_states, telemetry)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    async def run(self, req: RequestContext) -> AsyncIterator[pb.GenerateResponse]:
        if req.request_id in self._active:
            raise AlreadyExists(f"{req.request_id!r} is already in flight on this decode engine", field="request_id")
        self._active.add(req.request_id)
        try:
            async for response in self._run(req):
                yield response
        finally:
            self._active.discard(req.request_id)

    async def _run(self, req: RequestContext) -> AsyncIterator[pb.GenerateResponse]:
        loop = asyncio.get_running_loop()
        deadline, remote = req.deadline, req.remote
        key = req.request_id
        admit = admission_tokens(len(req.prompt))
        if remote is None:
            peer = self.peers.pick()  # fails fast (UNAVAILABLE) when no prefill is ready
            assert peer.link is not None
            check_fits_prefill(self.host, peer.link, req)
            computed = self.host.engine.num_prefill_tokens(len(req.prompt))
            chain, picked = chain_of(peer.link, self.host), peer.link  # a checkpoint's chain and link
            hit = self.prefix.lookup(chain, req.prompt, computed)
            state = self.states.lookup(chain, req.prompt, computed, hit, req.sampling)
            try:
                leading = hit.leading(self.prefix.kinds) if hit.entries else None
                local = await self.host.allocate_queued(key, admit, wait_deadline(deadline, loop.time()), leading=leading)
            except BaseException:
                hit.release()
                if state is not None:
                    self.states.release(state)
                raise
        else:
            hit, state, picked = Hit(), None, None
            try:
                peer = await self.learned.peer_for(remote)  # the named engine, params checked against it
                local = await self.host.allocate_queued(key, admit, wait_deadline(deadline, loop.time()))
            except BaseException as e:
                # Prefill pinned the state for whoever claims it: free it now, not at its lease's end.
                self.learned.give_up(remote, f"decode leg failed before its claim: {type(e).__name__}")
                raise
        compute = ComputeGuard(self.host)
        reads = ReadFence()
        parts = PartReads()
        target = ReadTarget(local)
        try:
            if state is not None and picked is not None:
                ended = None if state.first_token is None else req.stop.finish(state.first_token, 1)
                if ended is not None:  # the stored first token ends the request: no state is needed
                    for only in self._first_token_only(req, state, picked, ended):
                        yield only
                    return
                if await self.states.restored(compute.run, state, local):
                    async for restored in self._decode_restored(req, state, picked, local, compute, hit):
                        yield restored
                    return
            if not peer.ready and remote is not None:
                raise Unavailable(f"prefill {peer.name} was lost while this request waited for blocks", reason="PEER_UNAVAILABLE")
            if not peer.ready:  # lost while this request waited for blocks
                peer = self.peers.pick()
            job_sent = time.monotonic()
            if remote is None:  # another prefill engine takes the job if this one fails it before its manifest
                attempt = functools.partial(self._submit, req, hit, target, compute, reads, parts)
                try:
                    session, link, manifest = await on_some_prefill(
                        self.peers, peer, attempt, deadline, self._count_retry, retryable=lambda: not parts.any
                    )
                except BaseException as e:
                    if parts.source is not None:  # parts were (being) READ: release once no READ of theirs can land
                        await parts.cancel()
                        reads.when_released(
                            functools.partial(parts.source.release, key, f"read not completed: {type(e).__name__}")
                        )
                    raise
            else:
                assert peer.session is not None and peer.link is not None and remote.transfer_id is not None
                session, link = peer.session, peer.link
                manifest = await session.claim(remote.request_id, remote.transfer_id)
            prefill_seconds = time.monotonic() - job_sent
            pinned_as = manifest.request_id  # prefill's name for the pin (the prefill leg's id for a claim)
            out = ClientStream(tokenizer.for_engine(self.host.engine).stream(), req.started, self.telemetry)
            try:
                if remote is not None:
                    computed = self.host.engine.num_prefill_tokens(len(req.prompt))
                    check_claimed(remote, manifest, len(req.prompt), computed, req.prompt_field)
                local = self._reuse(manifest, hit, target, link.engine_id)
                first = first_token_of(manifest, self.host, link.engine_id)
                ended = None if first is None else req.stop.finish(first, 1)
                if ended is None:
                    read = _unless_session_ends(session, self._read_all(link, manifest, local, deadline, reads, parts))
                    if first is None:  # nothing to send meanwhile: no task of its own for the READ
                        stats = await read
                    else:
                        reading = asyncio.ensure_future(read)
                        try:
                            yield out.chunk([first])  # while the READ runs: the transfer hides behind it
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
                for response in (out.chunk([first]), out.tail()):
                    if response is not None:
                        yield response
                yield self._summary(
                    req, out, ended, Transfer(link, manifest, ReadStats(), prefill_seconds), transferred=0, read=False
                )
                return
            session.done_reading(pinned_as)
            self._count_read(stats)
            transfer = Transfer(link, manifest, stats, prefill_seconds)
            async for response in self._decode(req, transfer, local, compute, out, first, hit):
                yield response
        finally:
            compute.free_when_idle(key, reads, hit)
            if state is not None:
                self.states.release(state)

    async def _submit(
        self,
        req: RequestContext,
        hit: Hit,
        target: ReadTarget,
        compute: ComputeGuard,
        reads: ReadFence,
        parts: PartReads,
        peer: PrefillPeer,
    ) -> tuple[SessionClient, PeerLink, Manifest]:
        """The request's job on `peer`: the session and link it went through, and its (last)
        manifest; with --manifest-parts each earlier part is READ as it arrives (`parts`). The
        prefix cache's tokens are announced only to a prefill engine that writes the same K/V."""
        session, link = peer.session, peer.link
        if session is None or link is None:
            raise Unavailable(f"prefill {peer.name} was lost before the job was sent", reason="PEER_UNAVAILABLE")
        check_fits_prefill(self.host, link, req)
        now = asyncio.get_running_loop().time()
        cached = hit.tokens if hit.entries and hit.chain == chain_of(link, self.host) else 0

        def on_part(part: Manifest) -> None:
            parts.source = session
            try:  # before its READ: a part must never land in the prefix cache's shared blocks
                blocks = self._reuse(part, hit, target, link.engine_id)
            except ServiceError as e:
                parts.arrived(part, _raise(e))  # fails the request where the parts' READs are gathered
                return
            parts.arrived(part, self._read_part(req, link, part, blocks, compute, reads))

        parts.on_failure = functools.partial(session.fail_waiting, req.request_id)  # a failed part ends the wait
        manifest = await session.submit(
            req.request_id,
            req.prompt,
            wait_deadline(req.deadline, now) - now,
            req.sampling,
            on_part=on_part if self.manifest_parts else None,
            cached_tokens=cached,
        )
        return session, link, manifest

    def _reuse(self, manifest: Manifest, hit: Hit, target: ReadTarget, peer: str) -> RequestBlocks:
        """The blocks to READ into: with the hit's where prefill skipped its tokens, else fresh ones
        (a prefill that ignored the cached count, or another engine after a retry). Called for
        every manifest (each part, then the last): the first one decides, later ones agree."""
        if manifest.skipped_tokens == hit.tokens:
            return target.blocks
        if manifest.skipped_tokens:
            raise Internal(
                f"prefill {peer} skipped {manifest.skipped_tokens} prompt tokens; this decode engine holds {hit.tokens}",
                field="manifest.skipped_prompt_tokens",
                reason="BAD_MANIFEST",
            )
        target.blocks = self.prefix.unshare(hit, target.blocks)
        return target.blocks

    async def _read_part(
        self, req: RequestContext, link: PeerLink, part: Manifest, local: RequestBlocks, compute: ComputeGuard, reads: ReadFence
    ) -> ReadStats:
        """One part before the last: its READ, then its digests, while prefill computes on."""
        stats = await self._read(link, part, local, req.deadline, reads)
        if self.host.verify_transfer:
            await self._verify_digests(compute, req, part, link, local)
        return stats

    async def _read_all(
        self, link: PeerLink, manifest: Manifest, local: RequestBlocks, deadline: float, reads: ReadFence, parts: PartReads
    ) -> ReadStats:
        """The last (or only) manifest's READ, and the earlier parts' READs finishing meanwhile.
        `seconds`: from the last manifest to every READ done (the READ time left exposed)."""
        started = time.monotonic()
        try:
            parts.check_chain(manifest, link.engine_id)
            stats = await self._read(link, manifest, local, deadline, reads)
            stats.add(await parts.gather())
        except BaseException:
            await parts.cancel()
            raise
        stats.seconds = time.monotonic() - started
        return stats

    def _count_retry(self, reason: str) -> None:
        if self.telemetry is not None:
            self.telemetry.prefill_retries.labels(reason=reason).inc()

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
        await fault_hooks.pause("before_read", manifest.request_id)
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
        hit: Hit,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Decode steps from the READ state (after `first_token`, already sent, at the full-N
        boundary), streamed to the client, then the summary."""
        link, manifest = transfer.link, transfer.manifest
        assert manifest is not None
        await fault_hooks.pause("after_read", req.request_id)
        num_computed = manifest.num_computed_tokens
        digest_check_seconds = 0.0
        if self.host.verify_transfer:
            checking = time.monotonic()
            await self._verify_digests(compute, req, manifest, link, local)
            await self._verify_cached(compute, req, hit, local)
            digest_check_seconds = time.monotonic() - checking
        if self.check_state:
            await self._check(compute, req.prompt, num_computed, local)
        # A state checkpoint of what was just READ and checked, before a decode step changes it;
        # not of a P/D leg's full-N state: its prefill leg drew the first token with its own body.
        if req.remote is None or first_token is None:
            state_bytes = transfer.stats.conv_bytes + transfer.stats.ssm_bytes
            chain = hit.chain or chain_of(link, self.host)
            await self.states.keep(
                compute.run, chain, link, req.prompt, local, num_computed, state_bytes, req.sampling, first_token
            )
        async for chunk in self._steps(req, num_computed, local, compute, out, first_token):
            yield chunk
        await self._keep_prefix(compute, req, hit, local, link, num_computed, manifest.skipped_tokens)
        tail = out.tail()
        if tail is not None:
            yield tail
        assert out.finish is not None
        yield self._summary(req, out, out.finish, transfer, transferred=num_computed, digest_check_seconds=digest_check_seconds)

    async def _steps(
        self,
        req: RequestContext,
        num_computed: int,
        local: RequestBlocks,
        compute: ComputeGuard,
        out: ClientStream,
        first_token: int | None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Decode steps from the state in `local` until the request finishes (`out.finish`)."""
        loop = asyncio.get_running_loop()
        blocks = GrowingBlocks(self.host, local, len(req.prompt))
        sampling, stop, deadline = req.sampling, req.stop, req.deadline
        decode = await compute.run(
            lambda: self.host.engine.start_decode(
                req.prompt, num_computed, local, blocks.ensure, sampling=sampling, first_token=first_token
            )
        )
        while out.finish is None:
            generated = out.generated
            if loop.time() > deadline:
                raise DeadlineExceeded(f"deadline passed after {generated} of {req.max_tokens} tokens")
            # The first token alone (time to first token), then chunks: fewer hops to the compute thread.
            n = 1 if generated == 0 else min(MAX_TOKENS_PER_CHUNK, req.max_tokens - generated)
            n = await blocks.room_for(n, deadline)  # waits (on the loop) only while not one step fits
            ids, out.finish = await compute.run(functools.partial(steps, decode, n, stop, generated))
            yield out.chunk(ids)

    async def _decode_restored(
        self, req: RequestContext, state: Checkpoint, link: PeerLink, local: RequestBlocks, compute: ComputeGuard, hit: Hit
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Decode from a restored state checkpoint, as after a READ: no prefill job, nothing READ.
        At full-N its first token goes out first, then decoding continues by feeding it."""
        out = ClientStream(tokenizer.for_engine(self.host.engine).stream(), req.started, self.telemetry)
        first = state.first_token
        if first is not None:
            yield out.chunk([first])  # before the checks and any decode step, as after a manifest
        await fault_hooks.pause("after_read", req.request_id)
        checking = time.monotonic()
        if self.host.verify_transfer:
            await self._verify_cached(compute, req, hit, local)
        if self.check_state:
            await self._check(compute, req.prompt, state.computed, local)
        digest_check_seconds = time.monotonic() - checking
        if self.telemetry is not None:
            self.telemetry.prefix_state_saved_bytes.inc(state.saved_bytes)
        async for chunk in self._steps(req, state.computed, local, compute, out, first):
            yield chunk
        await self._keep_prefix(compute, req, hit, local, link, state.computed, hit.tokens)
        tail = out.tail()
        if tail is not None:
            yield tail
        assert out.finish is not None
        yield self._summary(
            req,
            out,
            out.finish,
            Transfer(link, None, ReadStats(), 0.0),
            transferred=0,
            digest_check_seconds=digest_check_seconds,
            cached_tokens=state.computed,
        )

    def _first_token_only(
        self, req: RequestContext, state: Checkpoint, link: PeerLink, ended: FinishReason
    ) -> list[pb.GenerateResponse]:
        """A full-N checkpoint whose first token ends the request (a stop token, max_tokens 1):
        the token and the summary; nothing restored, no job, nothing READ (nor saved: a prefill
        job would not have READ either)."""
        assert state.first_token is not None
        out = ClientStream(tokenizer.for_engine(self.host.engine).stream(), req.started, self.telemetry)
        responses = [out.chunk([state.first_token])]
        tail = out.tail()
        if tail is not None:
            responses.append(tail)
        transfer = Transfer(link, None, ReadStats(), 0.0)
        responses.append(self._summary(req, out, ended, transfer, transferred=0, read=False, cached_tokens=state.computed))
        return responses

    async def _verify_cached(self, compute: ComputeGuard, req: RequestContext, hit: Hit, local: RequestBlocks) -> None:
        """The prefix cache's blocks must still have the digests they had when they entered
        (prefill's digests cover only what was READ); a corrupt entry leaves the cache."""
        if not hit.entries:
            return
        bad = await compute.run(lambda: self.prefix.verify(hit, local))
        if bad:
            self.prefix.discard(hit)
            raise DataLoss(
                f"request {req.request_id}: {len(bad)} of the {len(hit.entries)} prefix cache blocks it reused differ "
                f"from their digests (first: block {bad[0]} of the prompt); they left the cache",
                field="prompt_token_ids",
                reason="PREFIX_CACHE_MISMATCH",
            )

    async def _keep_prefix(
        self,
        compute: ComputeGuard,
        req: RequestContext,
        hit: Hit,
        local: RequestBlocks,
        link: PeerLink,
        num_computed: int,
        skipped: int,
    ) -> None:
        """A finished request's full prompt blocks READ from prefill go to the prefix cache."""
        if self.telemetry is not None and skipped:
            self.telemetry.prefix_cache_saved_bytes.inc(skipped_bytes(link, skipped))
        new = self.prefix.candidates(hit.chain or chain_of(link, self.host), req.prompt, num_computed, hit)
        if not new:
            return
        digests = await compute.run(lambda: self.prefix.block_digests(local, [i for i, _ in new]))
        self.prefix.insert(local, new, digests)

    def _summary(
        self,
        req: RequestContext,
        out: ClientStream,
        finish: FinishReason,
        transfer: Transfer,
        *,
        transferred: int,
        digest_check_seconds: float = 0.0,
        read: bool = True,
        cached_tokens: int | None = None,
    ) -> pb.GenerateResponse:
        """`read`: False when the request ended before any state was READ (or checked).
        `cached_tokens`: prompt tokens from decode's caches (None: what the manifest skipped)."""
        link, manifest, stats, started = transfer.link, transfer.manifest, transfer.stats, req.started
        restored = manifest is None  # a state checkpoint: no job, no READ
        if cached_tokens is None:
            cached_tokens = manifest.skipped_tokens if manifest is not None and read else 0
        return pb.GenerateResponse(
            summary=pb.GenerateSummary(
                request_id=req.request_id,
                prompt_token_count=len(req.prompt),
                generated_token_count=out.generated,
                num_transferred_tokens=transferred,
                finish_reason=finish_reason_message(finish),
                prefill_engine_id=link.engine_id,
                prefill_target=link.target,
                transfer=pb.TransferStats(
                    attention_bytes=stats.attention_bytes,
                    conv_bytes=stats.conv_bytes,
                    ssm_bytes=stats.ssm_bytes,
                    total_bytes=stats.total_bytes,
                    read_count=stats.read_count,
                    descriptor_count=stats.descriptor_count,
                ),
                prefill_duration=duration(transfer.prefill_seconds),
                read_duration=duration(stats.seconds),
                time_to_first_token=duration((out.first_token_at or time.monotonic()) - started),
                total_duration=duration(time.monotonic() - started),
                state_verified=self.check_state and read,
                digests_verified=self.host.verify_transfer and read,  # a restored checkpoint: its own digests
                digest_check_duration=duration(digest_check_seconds),
                prefill_digest_duration=nanoseconds(manifest.digest_ns if manifest is not None else 0),
                prefill_engine_duration=nanoseconds(manifest.engine_ns if manifest is not None else 0),
                seed=req.sampling.seed,
                prefix_cached_tokens=cached_tokens,
                prefix_state_reused=restored,
            )
        )

    def _count_read(self, stats: ReadStats) -> None:
        if self.telemetry is None or not stats.read_count:
            return
        t = self.telemetry
        moved = t.transferred_bytes_of
        moved["fa"].inc(stats.attention_bytes)
        moved["conv"].inc(stats.conv_bytes)
        moved["ssm"].inc(stats.ssm_bytes)
        t.transfer_seconds.observe(stats.seconds)
        for posting in stats.post_seconds:
            t.post_seconds.observe(posting)
        t.descriptors_per_read.observe(stats.descriptor_count / stats.read_count)

    @spans.traced(spans.DIGEST_CHECK)
    async def _verify_digests(
        self, compute: ComputeGuard, req: RequestContext, manifest: Manifest, link: PeerLink, local: RequestBlocks
    ) -> None:
        """What the READs left in our blocks must have the digests prefill took of what it wrote
        (that they are there, of our kind, was checked when the manifest arrived)."""
        expected = list(manifest.digests)
        layout, views, n, start = self.host.layout, self.host.views, manifest.tokens_to, manifest.tokens_from
        source = link.plan.prefill
        sections: tuple[Section, ...] = SECTIONS if manifest.last else ("fa",)  # a part before the last: its K/V only
        got = await compute.run(
            lambda: state_digests(layout, views, local.block_ids, n, source=source, tokens_from=start, sections=sections)
        )
        bad = compare_digests(layout, expected, got)
        if not bad:
            return
        if self.telemetry is not None:
            for m in bad:
                self.telemetry.digest_mismatches.labels(section=m.section).inc()
        readers = {
            p: [r.decode_rank for r in link.plan.ranks if any(x.prefill_rank == p for x in r.reads)] for p in range(source.tp)
        }
        shown = "; ".join(f"{m.describe()}, read by decode ranks {readers[m.rank]}" for m in bad[:5])
        which = "" if manifest.part is None else f" ({manifest.part.describe()})"
        raise DataLoss(
            f"request {req.request_id}: the state READ from prefill {link.engine_id}{which} differs from what it wrote in "
            f"{len(bad)} digests: {shown}",
            field="manifest.digests",
            reason="DIGEST_MISMATCH",
        )

    async def _check(self, compute: ComputeGuard, prompt: list[int], num_computed: int, local: RequestBlocks) -> None:
        mismatches = await compute.run(lambda: self.host.engine.check_state(prompt, num_computed, local))
        if mismatches:
            shown = "; ".join(mismatches[:5])
            raise DataLoss(f"transferred state differs from prefill's in {len(mismatches)} places: {shown}")


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
