"""The prefill side of one Session stream (one per decode engine).

Protocol (decode -> prefill / prefill -> decode):
- `hello` first, for a pair that completed the handshake with this very prefill incarnation;
  answered by `ready` (lease, heartbeat interval, credits). Anything else first: FAILED_PRECONDITION.
- `job` -> `manifest` or `failure` (in-band: a failed job never ends the stream); at the full-N
  boundary a job with `accept_first_token` gets a `first_token` first, the moment it is drawn.
  A job whose request id has a running job on this session fails ALREADY_EXISTS; one whose id
  is still pinned here (a request decode already read, its READ notifications on their way)
  starts once that pin ends, so a client may reuse an id the moment its request ended.
- `claim` takes over a request prefilled for a reader unknown at the time (vLLM's P/D prefill
  leg, prefill_svc/handoff.py) -> `manifest` or `failure`, as for a job (no credit is taken:
  its blocks were pinned before this session knew of it).
- `cancel` aborts a running job or ends a pinned request; `release` ends a pinned request (with
  `transfer_id`: an unclaimed one whose decode leg failed before its claim, named by both ids);
  `heartbeat` renews the leases of the named pinned requests.
- `ready` and every prefill `heartbeat` carry the engine's load (prefill_svc/load.py), which
  decode picks a prefill engine by.
- prefill sends `heartbeat` every interval and `drain` when it shuts down; then it refuses new
  jobs (UNAVAILABLE) and ends the stream once this session's running jobs and pins are done.

Credits: at most `max_pinned_requests` jobs of this session are running or pinned at once
(decode asks for a number, prefill grants at most its own `--max-pinned-requests`); further
jobs wait for a credit until shortly before their deadline, then fail RESOURCE_EXHAUSTED.

Pins belong to the decode engine *incarnation* (`DecodePeer.key`), not to the stream: when the
stream ends (decode died, or the network dropped it) they stay until read, released on a new
stream of the same incarnation, or their lease ends; a restarted decode engine cannot touch them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span, SpanKind
from opentelemetry.util.types import AttributeValue

from prefill_svc.handoff import Handoffs
from prefill_svc.job import job_from_message
from prefill_svc.jobs import JobRunner
from prefill_svc.load import LoadBoard
from prefill_svc.peers import DecodePeer, DecodePeers
from prefill_svc.pins import PinTable
from shared import observe
from shared.cache.manifest import Manifest
from shared.config import DEFAULT_MAX_BATCHED_TOKENS
from shared.engine.logprobs import TokenLogprobs
from shared.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted, ServiceError, Unavailable
from shared.logs import context as log_context
from shared.observe import Step
from shared.otel import spans
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.rpc.deadlines import wait_deadline
from shared.rpc.lifecycle import Lifecycle
from shared.rpc.logprobs_message import logprobs_message
from shared.rpc.manifest_message import manifest_message
from shared.rpc.proto_time import duration
from shared.rpc.status import code_number, to_rpc_status
from shared.runtime.engine_host import EngineHost
from shared.timeouts import within

log = logging.getLogger(__name__)

DEFAULT_MAX_PINNED = 256
HELLO_TIMEOUT_SECONDS = 10.0
# How long a job waits for an earlier pin of its request id on this session to end before it is
# refused ALREADY_EXISTS. Decode takes no second request with an id it is serving, so such a pin
# is one decode already read: its READ notifications are on their way (milliseconds), or its
# lease frees it. A client may reuse an id the moment its request ended.
REUSED_ID_WAIT_SECONDS = 10.0


@dataclass(frozen=True)
class SessionConfig:
    heartbeat_seconds: float
    lease_seconds: float
    max_pinned_requests: int = DEFAULT_MAX_PINNED
    prefill_chunk_tokens: int = 0  # --prefill-chunk-tokens: manifest parts for jobs that accept them (0: off)
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS  # --max-batched-tokens: a batched prefill step's budget
    manifest_part_tokens: int = 0  # --manifest-part-tokens: the least tokens a part carries (0: one per chunk)
    layer_parts: int = 0  # --layer-parts: the last chunk's state in this many layer parts (0: one part)
    prefix_cache_blocks: int = 0  # --prefix-cache-blocks: prefill's boundary cache (0: off)


def _failure(request_id: str, error: ServiceError) -> pb.SessionResponse:
    return pb.SessionResponse(
        failure=pb.JobFailure(
            request_id=request_id,
            status_code=code_number(error.status),
            message=error.message,
            status=to_rpc_status(error),
        )
    )


def _job_fields(
    prompt_tokens: int, status: str, error: str | None, manifest: Manifest | None, job_seconds: float
) -> dict[str, object]:
    """The numbers of a finished job's log line (and span): what it computed when it succeeded,
    the error when it failed."""
    fields: dict[str, object] = {"prompt_tokens": prompt_tokens}
    if manifest is not None:
        fields.update(
            computed_tokens=manifest.num_computed_tokens,
            blocks=sum(len(ids) for ids in manifest.block_ids),
            prefill_ms=round(manifest.prefill_ns / 1e6, 3),
        )
    if error is not None:
        fields["error"] = error
    fields.update(status=status, job_ms=round(job_seconds * 1e3, 3))
    return fields


class PrefillSession:
    def __init__(
        self,
        *,
        host: EngineHost,
        pins: PinTable,
        peers: DecodePeers,
        runner: JobRunner,
        lifecycle: Lifecycle,
        config: SessionConfig,
        handoffs: Handoffs | None = None,
        load: LoadBoard | None = None,
    ) -> None:
        self.host = host
        self.load = load or LoadBoard(pins)  # shared by every session of the engine
        self.handoffs = handoffs
        self.pins = pins
        self.peers = peers
        self.runner = runner
        self.lifecycle = lifecycle
        self.config = config
        self.peer: DecodePeer | None = None
        self.owner = ""  # the peer's key: owner of this session's pins
        self.readers: list[int] = []
        self._out: asyncio.Queue[pb.SessionResponse | None] = asyncio.Queue()
        self._jobs: dict[str, asyncio.Task[None]] = {}
        self._credits = asyncio.Semaphore(DEFAULT_MAX_PINNED)
        self._max_pinned = DEFAULT_MAX_PINNED
        self._error: ServiceError | None = None  # ends the stream with this status

    # ---- handshake of the stream ----

    def _accept_hello(self, msg: pb.SessionRequest) -> pb.SessionResponse:
        if msg.WhichOneof("payload") != "hello":
            raise FailedPrecondition("the first message of a Session must be `hello`", field="hello", reason="SESSION_NOT_OPENED")
        hello = msg.hello
        peer = self.peers.get(hello.decode_engine_id, hello.decode_incarnation)
        if peer is None:
            raise FailedPrecondition(
                f"decode engine {hello.decode_engine_id!r} (incarnation {hello.decode_incarnation:x}) has not "
                "completed a Handshake with this prefill engine; call Handshake first",
                field="hello.decode_engine_id",
                reason="HANDSHAKE_REQUIRED",
            )
        if hello.prefill_incarnation != self.host.incarnation:
            raise FailedPrecondition(
                f"this prefill engine restarted (incarnation {self.host.incarnation:x}, the session names "
                f"{hello.prefill_incarnation:x}): handshake again so no READ targets old memory",
                field="hello.prefill_incarnation",
                reason="PEER_RESTARTED",
            )
        readers = list(hello.readers_per_prefill_rank)
        d_tp = peer.layout.tp_size
        if len(readers) != self.host.layout.tp or any(r > d_tp for r in readers) or not any(readers):
            raise InvalidArgument(
                f"{readers}: need one count per prefill rank ({self.host.layout.tp}), each 0..{d_tp}, not all 0",
                field="hello.readers_per_prefill_rank",
            )
        self.peer = peer
        self.owner = peer.key
        self.readers = readers
        cap = self.config.max_pinned_requests
        self._max_pinned = min(hello.max_pinned_requests or cap, cap)
        self._credits = asyncio.Semaphore(self._max_pinned)
        return pb.SessionResponse(
            ready=pb.SessionReady(
                prefill_engine_id=self.host.engine_id,
                prefill_incarnation=self.host.incarnation,
                lease_duration=duration(self.config.lease_seconds),
                heartbeat_interval=duration(self.config.heartbeat_seconds),
                max_pinned_requests=self._max_pinned,
                load=self.load.report(self.owner),
            )
        )

    # ---- the stream ----

    async def stream(self, requests: AsyncIterator[pb.SessionRequest]) -> AsyncIterator[pb.SessionResponse]:
        self.lifecycle.check_accepting("new sessions")
        try:
            first = await within(anext(requests), HELLO_TIMEOUT_SECONDS)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise FailedPrecondition(f"no `hello` within {HELLO_TIMEOUT_SECONDS:g}s", field="hello") from None
        yield self._accept_hello(first)
        assert self.peer is not None
        self.peers.session_opened(self.peer)
        log.info(
            "session opened by decode engine %s (readers per rank %s, %d credits)", self.owner, self.readers, self._max_pinned
        )  # fmt: skip
        tasks = [
            asyncio.ensure_future(self._read_loop(requests)),
            asyncio.ensure_future(self._heartbeat_loop()),
            asyncio.ensure_future(self._drain_watch()),
        ]
        try:
            while True:
                item = await self._out.get()
                if item is None:
                    break
                yield item
            if self._error is not None:
                raise self._error
        finally:
            for task in tasks:
                task.cancel()
            for job in self._jobs.values():
                job.cancel()
            self.peers.session_closed(self.peer)
            log.info(
                "session of decode engine %s ended (%d requests stay pinned until read, released or their lease ends)",
                self.owner, self.pins.count_for(self.owner),
            )  # fmt: skip

    async def _read_loop(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("payload")
                if kind == "job":
                    self._start_job(msg.job)
                elif kind == "claim":
                    self._claim(msg.claim)
                elif kind == "cancel":
                    self._cancel(msg.cancel.request_id, "cancelled")
                elif kind == "release":
                    self._release(msg.release)
                elif kind == "heartbeat":
                    self.pins.renew(self.owner, list(msg.heartbeat.request_ids))
                elif kind == "hello":
                    raise FailedPrecondition("`hello` sent twice on one Session", field="hello")
        except ServiceError as e:
            self._error = e
        finally:
            self._out.put_nowait(None)  # decode closed its side (or failed): end the stream

    async def _heartbeat_loop(self) -> None:
        # On a fixed schedule (no drift): decode judges silence against this interval.
        loop = asyncio.get_running_loop()
        interval = self.config.heartbeat_seconds
        due = loop.time()
        while True:
            due += interval
            await asyncio.sleep(max(0.0, due - loop.time()))
            count = self.pins.count_for(self.owner)
            beat = pb.PrefillHeartbeat(pinned_request_count=count, load=self.load.report(self.owner))
            self._out.put_nowait(pb.SessionResponse(heartbeat=beat))

    async def _drain_watch(self) -> None:
        await self.lifecycle.draining.wait()
        self._out.put_nowait(pb.SessionResponse(drain=pb.Drain(reason="prefill engine shutting down")))
        # Pinned requests may still be read (decode also sends release/heartbeats on this stream).
        while self._jobs or self.pins.count_for(self.owner):
            await asyncio.sleep(0.05)
        self._out.put_nowait(None)

    # ---- jobs ----

    def _start_job(self, job: pb.PrefillJob) -> None:
        observe.mark(Step.JOB_RECEIVED)
        rid = job.request_id
        if self.lifecycle.draining.is_set():
            self._out.put_nowait(
                _failure(rid, Unavailable("prefill engine is draining; send the job elsewhere", reason="DRAINING"))
            )
            return
        if not rid:
            self._out.put_nowait(_failure(rid, InvalidArgument("must be non-empty", field="job.request_id")))
            return
        if rid in self._jobs:
            self._already_in_flight(rid)
            return
        earlier = self.pins.lookup(self.owner, rid)
        # Tracing off: the job's own coroutine, no wrapper to resume at every await (as spans.traced does).
        work = self._job(job, None) if not spans.enabled() else self._traced_job(job)
        if earlier is not None and earlier.outcome is not None:
            work = self._after_pin(earlier.outcome, job, work)
        task = self._jobs[rid] = asyncio.ensure_future(work)
        owner, tokens = self.owner, max(0, len(job.prompt_token_ids) - job.cached_prompt_tokens)
        self.load.job_started(owner, tokens)
        # A callback, not the job's `finally`: a job cancelled before it first ran is counted out too.
        task.add_done_callback(lambda _: self.load.job_ended(owner, tokens))

    def _already_in_flight(self, rid: str) -> None:
        self._out.put_nowait(_failure(rid, AlreadyExists("is already in flight on this session", field="job.request_id")))

    async def _after_pin(self, ended: asyncio.Future[str], message: pb.PrefillJob, work: Coroutine[Any, Any, None]) -> None:
        """`work` (the job) once the earlier pin of its request id has ended (`ended`), within
        REUSED_ID_WAIT_SECONDS; else the job fails ALREADY_EXISTS, as a running duplicate would."""
        rid = message.request_id
        try:
            await within(asyncio.shield(ended), REUSED_ID_WAIT_SECONDS)
        except BaseException as e:  # the job never starts: nothing of it to undo but its entry
            work.close()
            self._jobs.pop(rid, None)
            if not isinstance(e, TimeoutError):
                raise
            self._already_in_flight(rid)
            return
        await work

    async def _traced_job(self, message: pb.PrefillJob) -> None:
        # A child of decode's request span when the job carries its trace context.
        attributes: dict[str, AttributeValue] = {
            "hybrid_pd.request_id": message.request_id,
            "hybrid_pd.prompt_tokens": len(message.prompt_token_ids),
        }
        with spans.current(
            spans.PREFILL_JOB, kind=SpanKind.CONSUMER, carrier=message.trace_context, attributes=attributes
        ) as span:
            await self._job(message, span)

    async def _job(self, message: pb.PrefillJob, span: Span | None) -> None:
        rid = message.request_id
        log_context.bind_request(rid, self.owner)  # this job's own task: every line of it names the request
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            job = job_from_message(message, owner=self.owner, readers_per_rank=self.readers, now=started)
        except ServiceError as e:  # a bad value in the message (sampling): answered like any failed job
            self._jobs.pop(rid, None)
            self._out.put_nowait(_failure(rid, e))
            return
        deadline = job.deadline
        credit_taken = False
        status = "INTERNAL"
        error: str | None = None
        manifest: Manifest | None = None
        try:
            now = loop.time()
            left = None if deadline is None else max(0.0, wait_deadline(deadline, now) - now)
            try:
                if self._credits.locked():  # (with no time left it would not even try)
                    await within(self._credits.acquire(), left)
                else:
                    await self._credits.acquire()
            except TimeoutError:
                raise ResourceExhausted(
                    f"all {self._max_pinned} credits of this session are held by pinned requests; none ended "
                    "before the job's deadline",
                    reason="NO_CREDIT",
                ) from None
            credit_taken = True

            def send_part(part: Manifest) -> None:
                nonlocal credit_taken
                credit_taken = False  # pinned before its first part: the pin returns the credit
                self._out.put_nowait(pb.SessionResponse(manifest=manifest_message(part)))

            def send_first_token(token: int, engine_seconds: float, logprobs: TokenLogprobs | None) -> None:
                first = pb.FirstToken(request_id=rid, token_id=token, engine_duration=duration(engine_seconds))
                if logprobs is not None:
                    first.logprobs.CopyFrom(logprobs_message(logprobs))
                self._out.put_nowait(pb.SessionResponse(first_token=first))

            manifest = await self.runner.run(job, on_end=self._credit_back, on_part=send_part, on_first_token=send_first_token)
            credit_taken = False  # now owned by the pin: returned when it ends
            self._out.put_nowait(pb.SessionResponse(manifest=manifest_message(manifest)))
            status = "OK"
        except ServiceError as e:
            status, error = e.status, e.message
            self._out.put_nowait(_failure(rid, e))
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except Exception:
            log.exception("prefill job %s failed", rid)
            self._out.put_nowait(_failure(rid, ServiceError("prefill failed (details in the prefill log)")))
        finally:
            if credit_taken:
                self._credits.release()
            self._jobs.pop(rid, None)
            # The line's numbers are gathered only when a handler or a span takes them.
            if span is not None or log.isEnabledFor(logging.INFO):
                done = manifest if status == "OK" else None
                fields = _job_fields(len(job.prompt), status, error, done, loop.time() - started)
                log.info("job %s finished: %s", rid, status, extra={"fields": fields})
                if span is not None:
                    attributes = {f"hybrid_pd.{k}": v for k, v in fields.items() if isinstance(v, (str, int, float))}
                    spans.settle(span, status, attributes)

    def _claim(self, claim: pb.ClaimPinned) -> None:
        attributes: dict[str, AttributeValue] = {
            "hybrid_pd.request_id": claim.request_id,
            "hybrid_pd.transfer_id": claim.transfer_id,
        }
        with spans.current(spans.CLAIM, kind=SpanKind.CONSUMER, carrier=claim.trace_context, attributes=attributes):
            self._claim_pinned(claim)

    def _claim_pinned(self, claim: pb.ClaimPinned) -> None:
        try:
            if self.handoffs is None:
                raise FailedPrecondition("this prefill engine does not serve P/D prefill legs", field="claim")
            if not claim.request_id:
                raise InvalidArgument("must be non-empty", field="claim.request_id")
            if claim.request_id in self._jobs:
                raise AlreadyExists("is already in flight on this session", field="claim.request_id")
            manifest = self.handoffs.claim(claim.request_id, claim.transfer_id, owner=self.owner, readers_per_rank=self.readers)
        except ServiceError as e:
            self._out.put_nowait(_failure(claim.request_id, e))
            return
        self._out.put_nowait(pb.SessionResponse(manifest=manifest_message(manifest)))

    def _credit_back(self, reason: str) -> None:
        self._credits.release()

    def _release(self, release: pb.ReleaseBlocks) -> None:
        if not release.transfer_id:
            self._cancel(release.request_id, "released")
        elif self.handoffs is not None and self.handoffs.give_up(release.request_id, release.transfer_id):
            log.info("request %s given up by decode engine %s before its claim: blocks freed", release.request_id, self.owner)
        else:  # claimed meanwhile, ended already, or ids that do not name one of our pins
            log.info(
                "decode engine %s gave up request %s (transfer %s) before its claim: no such unclaimed request here",
                self.owner, release.request_id, release.transfer_id,
            )  # fmt: skip

    def _cancel(self, request_id: str, reason: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            job.cancel()
        pin = self.pins.lookup(self.owner, request_id)
        if pin is not None:
            self.pins.release(pin, reason)
