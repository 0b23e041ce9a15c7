"""Requests whose prefilled blocks wait to be read: pinned until read, released, or expired.

A pin is created before its manifest leaves (so no notification can arrive unexpected) and
ends exactly once, for one of these reasons:
- `read`: every decode rank that reads from each prefill rank sent its NIXL notification;
- `released` / `cancelled`: decode said so on the Session stream;
- `lease_expired`: no heartbeat naming the request within the lease (decode died or hung);
- `shutdown`: the service is closing.
Only then are the blocks returned to the allocator, so no block a decode engine may still READ
is ever handed to another request before its lease ran out. A chunked prefill (manifest parts)
pins before its first part, while it still computes later chunks: it then expects one
notification per reader and part, and a pin that ends while a chunk computes frees the blocks
when that chunk is done (`Pin.writer`).

A pin made for a reader not known yet (vLLM's P/D prefill leg over HTTP) belongs to `UNCLAIMED`
and expects no notification; `claim()` hands it to the decode engine that names it, which then
owns it exactly like a pin of its own job. Unclaimed, it ends with its lease.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

from shared import observe
from shared.observe import RELEASE_REASON, Observer, Stage, Step
from shared.otel import spans
from shared.runtime.engine_host import EngineHost

log = logging.getLogger(__name__)

UNCLAIMED = ""  # owner of pins whose reader is not known yet (no decode engine key is empty)


@dataclass(eq=False)
class Pin:
    transfer_id: str  # allocator key and notification payload; unique per prefill incarnation
    request_id: str
    owner: str  # key of the decode engine incarnation that asked for it (DecodePeer.key)
    lease_deadline: float  # event-loop time
    waits: list[asyncio.Future[list[str]]] = field(default_factory=list)
    outcome: asyncio.Future[str] | None = None  # resolves with the reason when the pin ends
    on_end: Callable[[str], None] | None = None  # called once with the reason
    trace: Context | None = None  # the job's (or claim's) trace context: the release span's parent
    pinned_at: float = field(default_factory=time.monotonic)
    # A chunked prefill pins before its last chunk: the chunk computing into the blocks now
    # (None: nothing writes them any more). A pin that ends meanwhile frees them once it is done.
    writer: asyncio.Future[object] | None = None

    def lease_left(self) -> LeaseLeft:
        """The lease as a manifest carries it: what is left of it now, and when that runs out."""
        ns = max(0, int((self.lease_deadline - asyncio.get_running_loop().time()) * 1e9))
        return LeaseLeft(ns, time.time_ns() + ns)


@dataclass(frozen=True)
class LeaseLeft:
    ns: int  # nanoseconds of the lease left (0: it ran out); decode's timers use this
    expire_time_ns: int  # prefill's wall clock when it runs out, for people


class PinTable:
    def __init__(self, host: EngineHost, lease_seconds: float, observer: Observer | None = None) -> None:
        self.host = host
        self.lease_seconds = lease_seconds
        self.observer = observer or Observer()  # every pin that ends (Stage.RELEASE)
        self._pins: dict[str, Pin] = {}
        self._by_request: dict[tuple[str, str], str] = {}
        self.ended: Counter[str] = Counter()  # pins ended, by reason
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._pins)

    def blocks(self) -> int:
        """Cache blocks held by pins, every owner's."""
        return sum(self.host.allocator.held(tid) for tid in self._pins)

    def count_for(self, owner: str) -> int:
        return sum(1 for p in self._pins.values() if p.owner == owner)

    def pin(
        self,
        transfer_id: str,
        request_id: str,
        owner: str,
        readers_per_rank: list[int],
        on_end: Callable[[str], None] | None = None,
    ) -> Pin:
        """Pin a prefilled request's blocks; they are freed when every reader notified."""
        loop = asyncio.get_running_loop()
        pin = Pin(transfer_id, request_id, owner, self._lease_deadline(), on_end=on_end)
        self._trace(pin)
        self._pins[transfer_id] = pin
        self._by_request[(owner, request_id)] = transfer_id
        pin.outcome = loop.create_future()
        self._expect(pin, readers_per_rank)
        self._ensure_sweeper()
        observe.mark(Step.PINNED)
        return pin

    def _expect(self, pin: Pin, readers_per_rank: list[int]) -> None:
        key = pin.transfer_id.encode()
        pin.waits = [
            self.host.poller.expect(self.host.agents[rank], key, count)
            for rank, count in enumerate(readers_per_rank)
            if count > 0
        ]
        # A callback, not a task gathering the waits: the last notification frees the blocks in
        # the same event-loop turn that delivered it.
        for wait in pin.waits:
            wait.add_done_callback(functools.partial(self._on_wait_done, pin))

    def claim(self, request_id: str, transfer_id: str, owner: str, readers_per_rank: list[int]) -> Pin | None:
        """Hand an unclaimed pin to the decode engine `owner` (None: no such unclaimed pin: it
        expired, was claimed already, or never existed). Its READ notifications are expected from
        now on, before the claim is answered, and its lease starts again."""
        if self._by_request.get((UNCLAIMED, request_id)) != transfer_id or (owner, request_id) in self._by_request:
            return None
        pin = self._pins[transfer_id]
        del self._by_request[(UNCLAIMED, request_id)]
        pin.owner = owner
        self._by_request[(owner, request_id)] = transfer_id
        pin.lease_deadline = self._lease_deadline()
        self._trace(pin)
        self._expect(pin, readers_per_rank)
        return pin

    def _lease_deadline(self) -> float:
        """A lease that starts (or is renewed) now ends then, in event-loop time."""
        return asyncio.get_running_loop().time() + self.lease_seconds

    def lookup(self, owner: str, request_id: str) -> Pin | None:
        tid = self._by_request.get((owner, request_id))
        return None if tid is None else self._pins.get(tid)

    def renew(self, owner: str, request_ids: list[str]) -> int:
        """Extend the leases of the named requests; returns how many were found."""
        deadline = self._lease_deadline()
        found = 0
        for rid in request_ids:
            pin = self.lookup(owner, rid)
            if pin is not None:
                pin.lease_deadline = deadline
                found += 1
        return found

    def release(self, pin: Pin, reason: str) -> bool:
        """End a pin and free its blocks (idempotent: False if it had ended already)."""
        if self._pins.pop(pin.transfer_id, None) is None:
            return False
        self._by_request.pop((pin.owner, pin.request_id), None)
        for wait in pin.waits:
            wait.cancel()
        writer, tid = pin.writer, pin.transfer_id
        if writer is not None and not writer.done():
            freed = self.host.allocator.held(tid)
            writer.add_done_callback(lambda _: self.host.free(tid))
        else:
            freed = self.host.free(tid)
        self.ended[reason] += 1
        log.debug("request %s (%s) ended: %s, %d blocks freed", pin.request_id, pin.transfer_id, reason, freed)
        if pin.on_end is not None:
            pin.on_end(reason)
        if pin.outcome is not None and not pin.outcome.done():
            pin.outcome.set_result(reason)
        if self.observer.listening():
            attributes: dict[str, AttributeValue] = {
                "hybrid_pd.request_id": pin.request_id,
                "hybrid_pd.transfer_id": pin.transfer_id,
                RELEASE_REASON: reason,
                "hybrid_pd.blocks": freed,
            }
            self.observer.stage(Stage.RELEASE, time.monotonic() - pin.pinned_at, attributes, within=pin.trace)
        return True

    def _trace(self, pin: Pin) -> None:
        """Keep the current trace context (the job's or claim's span) for the release span."""
        pin.trace = spans.current_context()

    def _on_wait_done(self, pin: Pin, _wait: asyncio.Future[list[str]]) -> None:
        self._wait_done(pin)

    def _wait_done(self, pin: Pin) -> None:
        """One rank's notifications all arrived (or its wait was cancelled by a release)."""
        if all(w.done() and not w.cancelled() for w in pin.waits):
            self.release(pin, "read")

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        # Expiry is noticed at most a tick late: lease + lease/8 (capped at 0.25 s).
        tick = min(0.25, self.lease_seconds / 8)
        loop = asyncio.get_running_loop()
        while self._pins:
            await asyncio.sleep(tick)
            now = loop.time()
            for pin in [p for p in self._pins.values() if p.lease_deadline <= now]:
                log.warning(
                    "lease of request %s (decode %s) expired after %.1fs without news: freeing its blocks",
                    pin.request_id, pin.owner, self.lease_seconds,
                )  # fmt: skip
                self.release(pin, "lease_expired")

    async def aclose(self) -> None:
        for pin in list(self._pins.values()):
            self.release(pin, "shutdown")
        if self._sweeper is not None:
            self._sweeper.cancel()
