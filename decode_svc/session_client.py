"""Decode's end of one Session stream to a prefill engine (see prefill_svc/session.py).

One stream carries every request decode sends to that prefill engine. Jobs are matched to
their manifest or failure by request id. Decode heartbeats the requests whose blocks it still
needs (their leases are renewed), every heartbeat interval or a third of the lease, whichever
is shorter. Prefill heartbeats every interval; anything heard from it counts, and silence for
1.5 intervals (checked every quarter interval) means the peer is gone or frozen: the stream is
dropped and every request waiting on it fails with UNAVAILABLE naming the peer, at most
1.75 intervals after prefill's last message, so within two intervals of the failure.

Every write goes through one writer task. grpc.aio cancels a whole call when the task awaiting
one of its writes is cancelled, so a request (whose task is cancelled when its client goes
away) must never await a write on the shared stream itself: it only queues the message.

Manifests become domain manifests here, once, as they arrive: one that does not fit the prefill
engine (`ManifestSource`) fails its request with the error naming the field, and the request is
released on prefill at once.

Manifest parts (pipelined transfer, a job submitted with `on_part`): every part but the last
goes to `on_part` as it arrives, and the request's lease is heartbeated from the first part on;
the last part answers `submit`. Once a part has arrived, the blocks are released only by the
caller (`release`, after every READ of its parts is released, or `done_reading`): never here,
where a READ of an earlier part may still be in flight.

The first token early (the full-N boundary, a job submitted with `on_first_token`): prefill sends
it the moment it is drawn, before its digests, pin and manifest; it goes to `on_first_token` while
the job still waits for its manifest (which repeats it), and is dropped otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from opentelemetry.util.types import AttributeValue

from decode_svc.prefill_load import LoadReport, report_from_message
from shared import observe
from shared.cache.manifest import Manifest
from shared.engine.logprobs import TokenLogprobs
from shared.engine.sampling import GREEDY, SamplingParams
from shared.errors import ServiceError, Unavailable, error_for_status
from shared.observe import Stage, Step
from shared.otel import spans
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.logprobs_message import logprobs_of
from shared.rpc.manifest_message import ManifestSource, manifest_from_message
from shared.rpc.proto_time import duration, seconds
from shared.rpc.sampling_message import job_sampling_message
from shared.rpc.status import code_name, describe, from_rpc_status
from shared.runtime import faults

log = logging.getLogger(__name__)

OPEN_TIMEOUT_SECONDS = 10.0
SILENCE_INTERVALS = 1.5  # heartbeat intervals without a word from prefill before it is dropped


class SessionClient:
    def __init__(self, stub: pb_grpc.PrefillServiceAsyncStub, peer_name: str, source: ManifestSource) -> None:
        self.stub = stub
        self.peer_name = peer_name  # "engine-id (host:port)", for messages
        self.source = source  # what manifests from this peer are checked against
        self.ready: pb.SessionReady | None = None
        self.draining = False
        self.load: LoadReport | None = None  # the prefill's latest report (None: it never sent one)
        self.queued_tokens = 0  # the prompt tokens of this engine's jobs waiting for their manifest
        self.closed = asyncio.Event()
        self.close_reason = ""
        self._call: grpc.aio.StreamStreamCall[pb.SessionRequest, pb.SessionResponse] | None = None
        self._waiting: dict[str, asyncio.Future[Manifest]] = {}
        self._holding: set[str] = set()  # manifests received, blocks still needed
        self._parted: set[str] = set()  # of those, the ones a manifest part arrived for (the caller releases them)
        self._part_sinks: dict[str, Callable[[Manifest], None]] = {}  # requests taking manifest parts
        self._token_sinks: dict[
            str, Callable[[int, float, TokenLogprobs | None], None]
        ] = {}  # requests taking the first token early
        self._outbox: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()  # None: done writing
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = 0.0

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + len(self._holding)

    async def open(self, hello: pb.SessionHello) -> pb.SessionReady:
        """Open the stream and wait for `ready` (raises a ServiceError from the peer's status)."""
        call = self._call = self.stub.Session()  # long-lived: no deadline; heartbeats watch it instead
        try:
            async with asyncio.timeout(OPEN_TIMEOUT_SECONDS):
                await call.write(pb.SessionRequest(hello=hello))
                first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise describe(e).to_error() from None
        except TimeoutError:
            call.cancel()
            raise Unavailable(
                f"prefill {self.peer_name} did not answer the session hello within {OPEN_TIMEOUT_SECONDS:g}s"
            ) from None
        if not isinstance(first, pb.SessionResponse):  # EOF: the peer ended the stream
            raise self.ended_error()
        if first.WhichOneof("payload") != "ready":
            call.cancel()
            raise Unavailable(f"prefill {self.peer_name} answered the hello with {first.WhichOneof('payload')}")
        self.ready = first.ready
        self._heard_load(first.ready.HasField("load"), first.ready.load)
        self._last_heard = asyncio.get_running_loop().time()
        self._tasks = [
            asyncio.ensure_future(self._read_loop()),
            asyncio.ensure_future(self._heartbeat_loop()),
            asyncio.ensure_future(self._write_loop()),
        ]
        return self.ready

    # ---- requests ----

    async def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        timeout: float | None,
        sampling: SamplingParams = GREEDY,
        on_part: Callable[[Manifest], None] | None = None,
        *,
        cached_tokens: int = 0,
        on_first_token: Callable[[int, float, TokenLogprobs | None], None] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        fork_seeds: Sequence[int] = (),
    ) -> Manifest:
        """Send a job and wait for its manifest; a JobFailure raises its status as a ServiceError.
        `on_part`: the job accepts manifest parts, each but the last given to it as it arrives.
        `cached_tokens`: leading prompt tokens whose K/V decode's prefix cache holds.
        `on_first_token`: the job asks for its first token early (full-N), given to it on arrival
        with the prefill engine's seconds computing the prompt (0: a prefill that does not say) and
        its logprobs. `logprobs`: at the full-N boundary, the first token comes with its logprobs
        and the k likeliest tokens; `prompt_logprobs`: the manifest carries the prompt's; `fork_seeds`: at the full-N boundary prefill also draws
        the first token with each (the other sequences of a request of several)."""
        job = pb.PrefillJob(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling=job_sampling_message(sampling),
            accept_manifest_parts=on_part is not None,
            accept_layer_parts=on_part is not None,
            cached_prompt_tokens=cached_tokens,
            accept_first_token=on_first_token is not None,
        )
        if logprobs is not None:
            job.logprobs = logprobs
        if prompt_logprobs is not None:
            job.prompt_logprobs = prompt_logprobs
        job.fork_seeds.extend(fork_seeds)
        if timeout is not None:
            job.timeout.CopyFrom(duration(timeout))
        spans.inject(job.trace_context)  # prefill's job span joins this request's trace
        if on_part is not None:
            self._part_sinks[request_id] = on_part
        if on_first_token is not None:
            self._token_sinks[request_id] = on_first_token
        tokens = max(0, len(job.prompt_token_ids) - cached_tokens)
        self.queued_tokens += tokens
        try:
            return await self._ask(request_id, pb.SessionRequest(job=job))
        finally:
            self.queued_tokens -= tokens
            self._part_sinks.pop(request_id, None)
            self._token_sinks.pop(request_id, None)

    async def claim(self, request_id: str, transfer_id: str) -> Manifest:
        """Take over a request prefill pinned for a reader unknown at the time (vLLM's P/D prefill
        leg); its manifest, or its JobFailure raised as a ServiceError."""
        # Also while prefill drains: the state exists already, and a drain waits for pinned requests.
        claim = pb.ClaimPinned(request_id=request_id, transfer_id=transfer_id)
        spans.inject(claim.trace_context)
        return await self._ask(request_id, pb.SessionRequest(claim=claim), new_work=False)

    async def _ask(self, request_id: str, msg: pb.SessionRequest, *, new_work: bool = True) -> Manifest:
        if self.closed.is_set():
            raise self.ended_error()
        if new_work and self.draining:
            raise Unavailable(f"prefill {self.peer_name} is draining", reason="DRAINING")
        if request_id in self._waiting or request_id in self._holding:
            raise ServiceError(f"request id {request_id!r} is already in flight to {self.peer_name}")
        future: asyncio.Future[Manifest] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        queued = time.monotonic()
        try:
            observe.mark(Step.JOB_QUEUED)
            self._send(msg)
            manifest = await future
        except asyncio.CancelledError:
            # Cancelled while the job ran, or just after its last manifest arrived (the caller
            # never sees that one): nobody will release it, so cancel it on prefill now. Once a
            # part has arrived, READs of it may be in flight: then the caller releases.
            if request_id not in self._parted and (
                self._waiting.pop(request_id, None) is not None or request_id in self._holding
            ):
                self._holding.discard(request_id)
                self._send(pb.SessionRequest(cancel=pb.CancelJob(request_id=request_id)))
            raise
        finally:
            self._waiting.pop(request_id, None)
        if observe.listening():  # in the request's task: its span is current
            observe.stage(Stage.MANIFEST, time.monotonic() - queued, manifest_attributes(manifest, self.peer_name))
        return manifest

    def fail_waiting(self, request_id: str, error: BaseException) -> None:
        """End a job's wait for its manifest with `error` (a part of it failed here: its READ or
        its digests), in the task that waits, so nothing it received is lost to a second task."""
        future = self._waiting.get(request_id)
        if future is not None and not future.done():
            future.set_exception(error)

    def release(self, request_id: str, reason: str) -> None:
        """Tell prefill to free a request's blocks now (failed or cancelled READ, nothing to read).

        Does not wait for the write: a failing request must not wait on a stuck stream (if the
        message is lost with the stream, the lease frees the blocks)."""
        self._holding.discard(request_id)
        self._parted.discard(request_id)
        self._send(pb.SessionRequest(release=pb.ReleaseBlocks(request_id=request_id, reason=reason)))

    def give_up(self, request_id: str, transfer_id: str, reason: str) -> None:
        """Free a request prefill pinned for us unasked (vLLM's P/D prefill leg), never claimed:
        its decode leg failed first. Prefill checks both ids (if the message is lost, the lease
        frees the blocks)."""
        self._send(pb.SessionRequest(release=pb.ReleaseBlocks(request_id=request_id, reason=reason, transfer_id=transfer_id)))

    def done_reading(self, request_id: str) -> None:
        """The READs finished (prefill frees on their notifications): stop renewing the lease."""
        self._holding.discard(request_id)
        self._parted.discard(request_id)

    async def close(self) -> None:
        writer = self._tasks[-1] if self._tasks else None
        for task in self._tasks[:-1]:
            task.cancel()
        if writer is not None:
            self._outbox.put_nowait(None)  # queued releases go out, then done_writing
            await asyncio.wait({writer}, timeout=1.0)  # never hang on a dead peer
            writer.cancel()
        if self._call is not None:
            self._call.cancel()
        self._end(f"session to prefill {self.peer_name} closed")

    # ---- stream plumbing ----

    def _send(self, msg: pb.SessionRequest) -> None:
        """Queue a message for the writer (in order); dropped once the session is closed."""
        if not self.closed.is_set():
            self._outbox.put_nowait(msg)

    async def _write_loop(self) -> None:
        assert self._call is not None
        try:
            while (msg := await self._outbox.get()) is not None:
                await self._call.write(msg)
            await self._call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            log.debug("writing to prefill %s failed: %s", self.peer_name, e)
            self._end(f"session to prefill {self.peer_name} lost (write failed)")

    async def _read_loop(self) -> None:
        assert self._call is not None
        loop = asyncio.get_running_loop()
        reason = f"prefill {self.peer_name} ended the session"
        try:
            while True:
                msg = await self._call.read()
                if not isinstance(msg, pb.SessionResponse):  # EOF
                    break
                self._last_heard = loop.time()
                kind = msg.WhichOneof("payload")
                if kind == "manifest":
                    self._arrived(msg.manifest)
                elif kind == "failure":
                    self._resolve(msg.failure.request_id, error=job_error(self.peer_name, msg.failure))
                elif kind == "first_token":
                    self._first_token(msg.first_token)
                elif kind == "heartbeat":
                    self._heard_load(msg.heartbeat.HasField("load"), msg.heartbeat.load)
                elif kind == "drain":
                    self.draining = True
                    log.info("prefill %s is draining: %s", self.peer_name, msg.drain.reason)
        except grpc.aio.AioRpcError as e:
            failure = describe(e)
            reason = f"session to prefill {self.peer_name} lost: {failure.status} {failure.message}"
        except asyncio.CancelledError:
            reason = f"session to prefill {self.peer_name} closed"
            raise
        finally:
            self._end(reason)

    async def _heartbeat_loop(self) -> None:
        assert self.ready is not None
        interval = max(0.05, seconds(self.ready.heartbeat_interval))
        lease = seconds(self.ready.lease_duration)
        send_every = min(interval, lease / 3) if lease > 0 else interval
        silence_limit = SILENCE_INTERVALS * interval
        tick = min(send_every, interval / 4)
        loop = asyncio.get_running_loop()
        next_send = loop.time() + send_every
        while not self.closed.is_set():
            due = loop.time() + tick
            await asyncio.sleep(tick)
            now = loop.time()
            if now - due > interval:
                # This process did not run for a while (CPU starved, stopped): the silence may be
                # ours, and what the peer sent meanwhile is still unread. Give it a fresh window.
                self._last_heard = max(self._last_heard, now)
            if now - self._last_heard > silence_limit:
                log.warning("prefill %s silent for %.2fs: dropping the session", self.peer_name, now - self._last_heard)
                if self._call is not None:
                    self._call.cancel()
                self._end(f"prefill {self.peer_name} stopped answering (nothing heard for {now - self._last_heard:.2f}s)")
                return
            if now >= next_send:
                next_send = now + send_every
                self._send(pb.SessionRequest(heartbeat=pb.DecodeHeartbeat(request_ids=sorted(self._holding))))

    def _heard_load(self, present: bool, msg: pb.PrefillLoad) -> None:
        if present:  # a peer that does not report keeps `load` None: unknown, not idle
            self.load = report_from_message(msg)

    def _arrived(self, msg: pb.Manifest) -> None:
        try:
            manifest = manifest_from_message(msg, self.source)
        except ServiceError as e:
            held = msg.request_id in self._parted  # parts of it were READ: the caller releases it
            self._resolve(msg.request_id, error=e)
            if not held:
                self.release(msg.request_id, f"manifest refused: {e.reason}")
            return
        self._resolve(msg.request_id, manifest=manifest)
        faults.manifest_delivered(msg.request_id)

    def _resolve(self, request_id: str, *, manifest: Manifest | None = None, error: ServiceError | None = None) -> None:
        observe.mark(Step.MANIFEST_RECEIVED)
        if manifest is not None and not manifest.last:
            self._part_arrived(request_id, manifest)
            return
        future = self._waiting.pop(request_id, None)
        if future is None or future.done():
            if manifest is not None and request_id not in self._parted:
                # Nobody waits any more (cancelled meanwhile): free it on prefill right away.
                self.release(request_id, "no longer wanted")
            return
        if manifest is not None:
            self._holding.add(request_id)
            future.set_result(manifest)
        else:
            assert error is not None
            future.set_exception(error)

    def _first_token(self, msg: pb.FirstToken) -> None:
        """A job's first token ahead of its manifest: to its sink while the job still waits (a
        job cancelled meanwhile, or one that never asked, has none)."""
        sink = self._token_sinks.get(msg.request_id)
        waiting = self._waiting.get(msg.request_id)
        if sink is not None and waiting is not None and not waiting.done():
            sink(msg.token_id, seconds(msg.engine_duration), logprobs_of(msg.logprobs) if msg.HasField("logprobs") else None)

    def _part_arrived(self, request_id: str, part: Manifest) -> None:
        sink = self._part_sinks.get(request_id)
        waiting = self._waiting.get(request_id)
        if sink is None or waiting is None or waiting.done():
            if request_id not in self._parted:  # no READ of ours can be on it: free it now
                self.release(request_id, "no longer wanted")
            return
        self._holding.add(request_id)  # heartbeats renew its lease from the first part on
        self._parted.add(request_id)
        sink(part)

    def has_parts(self, request_id: str) -> bool:
        """Whether a manifest part of the request arrived here and went to its caller (whose READs
        of it may be in flight: the caller releases the request, not a cancel)."""
        return request_id in self._parted

    def ended_error(self) -> Unavailable:
        return Unavailable(self.close_reason or f"session to prefill {self.peer_name} is closed", reason="PEER_UNAVAILABLE")

    def _end(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self.ended_error())
        self._waiting.clear()


def manifest_attributes(manifest: Manifest, peer_name: str) -> dict[str, AttributeValue]:
    return {
        "hybrid_pd.prefill": peer_name,
        "hybrid_pd.transfer_id": manifest.transfer_id,
        "hybrid_pd.computed_tokens": manifest.num_computed_tokens,
        "hybrid_pd.blocks": sum(len(ids) for ids in manifest.block_ids),
        "hybrid_pd.prefill_ms": round(manifest.prefill_ns / 1e6, 3),
        "hybrid_pd.lease_ms": round(manifest.lease_ns / 1e6, 3),
    }


def job_error(peer_name: str, failure: pb.JobFailure) -> ServiceError:
    """The ServiceError prefill failed a job with: status, reason and fields from its
    google.rpc.Status (a peer that sends only the code and message gives those alone)."""
    if failure.HasField("status"):
        error = from_rpc_status(failure.status).to_error()
    else:
        error = error_for_status(code_name(failure.status_code), failure.message)
    error.message = f"prefill {peer_name}: {error.message}"
    error.args = (error.message,)
    return error
