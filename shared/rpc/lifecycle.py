"""Start-to-exit of a service process: signals and the SIGTERM drain (grpc-conventions 1.2).

Drain sequence, on the first SIGTERM or SIGINT:
1. health goes NOT_SERVING for every name at once (load balancers and probes stop sending);
2. `draining` is set: handlers refuse new work with UNAVAILABLE (reason DRAINING), sessions
   tell their peers;
3. the server keeps listening while the service's in-flight work finishes (`wait_idle`), for
   at most `grace` seconds: a call arriving now still gets a handler, and so a clear
   UNAVAILABLE, instead of being cut off by a server that is already stopping (CANCELLED);
4. past the grace, requests still running (those registered with `track()`) are cancelled and
   end with our own UNAVAILABLE (reason DRAIN_GRACE_ENDED: "retry on another instance"), not
   gRPC's "Cancelling all calls"; then `server.stop(...)`: the listener closes; what is left
   (health Watch streams, Session streams) gets at most FINAL_GRACE_SECONDS, and after a cut
   exactly that: a cut request's handler has ended, but its status may still be on its way
   out, and a server stopping at once would cancel the call under it;
5. the caller closes its data plane and the process exits 0.
A second signal skips the rest of the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator

import grpc

from shared.errors import Unavailable
from shared.rpc.health import HealthStatus

log = logging.getLogger(__name__)

FINAL_GRACE_SECONDS = 1.0


class Lifecycle:
    def __init__(self, health: HealthStatus, grace_seconds: float) -> None:
        self.health = health
        self.grace_seconds = grace_seconds
        self.draining = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._force = asyncio.Event()
        self.past_grace = False  # set once the grace ran out and tracked requests are being cut
        self._tracked: set[asyncio.Task[object]] = set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Mark the current task as one request the drain may cut at the end of its grace."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._tracked.add(task)
        try:
            yield
        finally:
            self._tracked.discard(task)

    def grace_ended_error(self) -> Unavailable:
        return Unavailable(
            f"this service shut down before the request finished (its {self.grace_seconds:g}s drain grace ran out); "
            "retry on another instance",
            reason="DRAIN_GRACE_ENDED",
        )

    async def _cut_tracked(self) -> None:
        """Cancel the requests still running; each turns the cancellation into grace_ended_error()."""
        self.past_grace = True
        cut = list(self._tracked)
        for task in cut:
            task.cancel()
        if cut:
            await asyncio.wait(cut, timeout=FINAL_GRACE_SECONDS)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)

    def remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def request_stop(self, why: str = "stop requested") -> None:
        if self._stop_requested.is_set():
            log.warning("%s again: ending the drain now", why)
            self._force.set()
            return
        log.info("%s: draining (grace %.1fs)", why, self.grace_seconds)
        self._stop_requested.set()

    async def wait_for_stop(self) -> None:
        await self._stop_requested.wait()

    def check_accepting(self, what: str = "new requests") -> None:
        """Raise UNAVAILABLE while draining, so clients retry on another instance."""
        if self.draining.is_set():
            raise Unavailable(f"this service is shutting down and takes no {what}; retry on another instance", reason="DRAINING")

    async def drain(
        self,
        server: grpc.aio.Server,
        on_draining: Callable[[], Awaitable[None]] | None = None,
        wait_idle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Steps 1-4 of the module docstring; returns once the server has stopped."""
        loop = asyncio.get_running_loop()
        end_of_grace = loop.time() + self.grace_seconds
        self._stop_requested.set()
        self.draining.set()
        await self.health.shutdown()
        if on_draining is not None:
            await on_draining()
        force = asyncio.ensure_future(self._force.wait())
        cut = False
        try:
            if wait_idle is not None:
                idle = asyncio.ensure_future(wait_idle())
                await asyncio.wait({idle, force}, timeout=self.grace_seconds, return_when=asyncio.FIRST_COMPLETED)
                if not idle.done():
                    idle.cancel()
                    log.warning(
                        "in-flight work did not finish within the %.1fs grace: cutting off %d requests",
                        self.grace_seconds, len(self._tracked),
                    )  # fmt: skip
                    await self._cut_tracked()
                    cut = True
            left = FINAL_GRACE_SECONDS if cut else max(0.0, min(end_of_grace - loop.time(), FINAL_GRACE_SECONDS))
            stop = asyncio.ensure_future(server.stop(None if self._force.is_set() else left))
            await asyncio.wait({stop, force}, return_when=asyncio.FIRST_COMPLETED)
            if not stop.done():
                await server.stop(None)
            await stop
        finally:
            force.cancel()
