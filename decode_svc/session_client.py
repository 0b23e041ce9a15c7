"""Decode's end of one Session stream to a prefill engine (see prefill_svc/session.py).

One stream carries every request decode sends to that prefill engine. Jobs are matched to
their manifest or failure by request id. Decode heartbeats the requests whose blocks it still
needs (their leases are renewed); prefill heartbeats too, and silence for two intervals means
the peer is gone: every waiting request fails with UNAVAILABLE naming the peer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import grpc

from shared.errors import ServiceError, Unavailable, error_for_status
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.pb.hybridpd.v1 import prefill_service_pb2_grpc as pb_grpc
from shared.rpc.proto_time import duration, seconds
from shared.rpc.status import code_name, describe

log = logging.getLogger(__name__)

OPEN_TIMEOUT_SECONDS = 10.0



class SessionClient:
    def __init__(self, stub: pb_grpc.PrefillServiceAsyncStub, peer_name: str) -> None:
        self.stub = stub
        self.peer_name = peer_name  # "engine-id (host:port)", for messages
        self.ready: pb.SessionReady | None = None
        self.draining = False
        self.closed = asyncio.Event()
        self.close_reason = ""
        self._call: grpc.aio.StreamStreamCall[pb.SessionRequest, pb.SessionResponse] | None = None
        self._waiting: dict[str, asyncio.Future[pb.Manifest]] = {}
        self._holding: set[str] = set()  # manifests received, blocks still needed
        self._write_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = 0.0

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + len(self._holding)

    async def open(self, hello: pb.SessionHello) -> pb.SessionReady:
        """Open the stream and wait for `ready` (raises a ServiceError from the peer's status)."""
        call = self._call = self.stub.Session()
        try:
            await call.write(pb.SessionRequest(hello=hello))
            first = await asyncio.wait_for(call.read(), OPEN_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as e:
            raise describe(e).to_error() from None
        except TimeoutError:
            call.cancel()
            raise Unavailable(f"prefill {self.peer_name} did not answer the session hello within {OPEN_TIMEOUT_SECONDS:g}s") from None
        if not isinstance(first, pb.SessionResponse):  # EOF: the peer ended the stream
            raise self.ended_error()
        if first.WhichOneof("payload") != "ready":
            call.cancel()
            raise Unavailable(f"prefill {self.peer_name} answered the hello with {first.WhichOneof('payload')}")
        self.ready = first.ready
        self._last_heard = asyncio.get_running_loop().time()
        self._tasks = [asyncio.ensure_future(self._read_loop()), asyncio.ensure_future(self._heartbeat_loop())]
        return self.ready

    # ---- requests ----

    async def submit(self, request_id: str, prompt: Sequence[int], timeout: float | None) -> pb.Manifest:
        """Send a job and wait for its manifest; a JobFailure raises its status as a ServiceError."""
        if self.closed.is_set():
            raise self.ended_error()
        if self.draining:
            raise Unavailable(f"prefill {self.peer_name} is draining", reason="DRAINING")
        if request_id in self._waiting or request_id in self._holding:
            raise ServiceError(f"request id {request_id!r} is already in flight to {self.peer_name}")
        future: asyncio.Future[pb.Manifest] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        job = pb.PrefillJob(request_id=request_id, prompt_token_ids=list(prompt))
        if timeout is not None:
            job.timeout.CopyFrom(duration(timeout))
        try:
            await self._write(pb.SessionRequest(job=job))
            manifest = await future
        except asyncio.CancelledError:
            if self._waiting.pop(request_id, None) is not None or request_id in self._holding:
                self._holding.discard(request_id)
                await self._send_quietly(pb.SessionRequest(cancel=pb.CancelJob(request_id=request_id)))
            raise
        finally:
            self._waiting.pop(request_id, None)
        return manifest

    async def release(self, request_id: str, reason: str) -> None:
        """Tell prefill to free a request's blocks now (failed or cancelled READ, nothing to read)."""
        self._holding.discard(request_id)
        await self._send_quietly(pb.SessionRequest(release=pb.ReleaseBlocks(request_id=request_id, reason=reason)))

    def done_reading(self, request_id: str) -> None:
        """The READs finished (prefill frees on their notifications): stop renewing the lease."""
        self._holding.discard(request_id)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._call is not None:
            try:
                async with self._write_lock:
                    await self._call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
            self._call.cancel()
        self._end(f"session to prefill {self.peer_name} closed")

    # ---- stream plumbing ----

    async def _write(self, msg: pb.SessionRequest) -> None:
        assert self._call is not None
        try:
            async with self._write_lock:
                await self._call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            raise self.ended_error() from None

    async def _send_quietly(self, msg: pb.SessionRequest) -> None:
        try:
            await self._write(msg)
        except ServiceError as e:
            log.debug("could not send %s to %s: %s", msg.WhichOneof("payload"), self.peer_name, e)

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
                    self._resolve(msg.manifest.request_id, manifest=msg.manifest)
                elif kind == "failure":
                    f = msg.failure
                    self._resolve(f.request_id, error=error_for_status(code_name(f.status_code), f"prefill {self.peer_name}: {f.message}"))
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
        loop = asyncio.get_running_loop()
        while not self.closed.is_set():
            await asyncio.sleep(interval)
            if loop.time() - self._last_heard > 2 * interval:
                log.warning("prefill %s silent for %.1fs: dropping the session", self.peer_name, loop.time() - self._last_heard)
                if self._call is not None:
                    self._call.cancel()
                self._end(f"prefill {self.peer_name} stopped answering (no heartbeat for {2 * interval:.1f}s)")
                return
            await self._send_quietly(pb.SessionRequest(heartbeat=pb.DecodeHeartbeat(request_ids=sorted(self._holding))))

    def _resolve(self, request_id: str, *, manifest: pb.Manifest | None = None, error: ServiceError | None = None) -> None:
        future = self._waiting.pop(request_id, None)
        if future is None or future.done():
            if manifest is not None:
                # Nobody waits any more (cancelled meanwhile): free it on prefill right away.
                asyncio.ensure_future(self.release(request_id, "no longer wanted"))
            return
        if manifest is not None:
            self._holding.add(request_id)
            future.set_result(manifest)
        else:
            assert error is not None
            future.set_exception(error)

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
