"""Prefill for a reader not known yet: the prefill leg of vLLM's P/D protocol.

A P/D router sends the prompt to prefill alone. Prefill computes the state with the same
JobRunner a Session job uses, pins it for `UNCLAIMED` under a lease, and answers (over HTTP)
what a decode engine needs to find it: this engine, its gRPC address, the request and transfer
ids and the block ids. The lease starts again once that answer has been sent (`sent()`): the
router may take a while to pass it on. The decode engine then handshakes (if new), opens its
Session and claims the request there: it gets the request's Manifest and owns the pin from then
on, exactly as if it had sent the job itself. Unclaimed, the pin ends with its lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Sequence

from prefill_svc.job import Job
from prefill_svc.jobs import JobRunner
from prefill_svc.pins import UNCLAIMED, PinTable
from shared.cache.manifest import Manifest
from shared.engine.sampling import GREEDY, SamplingParams
from shared.errors import AlreadyExists, FailedPrecondition

# The prefill leg waits this long for cache blocks while the cache is full (then 429).
PREFILL_LEG_TIMEOUT_SECONDS = 60.0


class Handoffs:
    def __init__(self, runner: JobRunner, pins: PinTable) -> None:
        self.runner = runner
        self.pins = pins
        self._unclaimed: dict[str, Manifest] = {}  # transfer id -> the manifest a claim gets

    def __len__(self) -> int:
        return len(self._unclaimed)

    async def prefill(
        self,
        request_id: str,
        prompt: Sequence[int],
        timeout: float = PREFILL_LEG_TIMEOUT_SECONDS,
        *,
        sampling: SamplingParams = GREEDY,
    ) -> Manifest:
        """Compute and pin the prompt's state for whoever claims it (errors name `job.*` fields);
        at the full-N boundary its first token is drawn with `sampling`."""
        if self.pins.lookup(UNCLAIMED, request_id) is not None:
            raise AlreadyExists(
                f"{request_id!r} is already prefilled here and waits for its decode engine", field="job.request_id"
            )
        deadline = asyncio.get_running_loop().time() + timeout
        job = Job(request_id, list(prompt), deadline, owner=UNCLAIMED, readers_per_rank=[], sampling=sampling)
        manifest = await self.runner.run(job)
        # No await since the pin was made: it cannot have ended yet.
        pin = self.pins.lookup(UNCLAIMED, request_id)
        assert pin is not None and pin.transfer_id == manifest.transfer_id
        pin.on_end = functools.partial(self._ended, manifest.transfer_id)
        self._unclaimed[manifest.transfer_id] = manifest
        return manifest

    async def sent(self, request_id: str) -> None:
        """The answer left: the lease counts from now (a no-op once claimed or ended). A
        coroutine so that the HTTP server runs it on the event loop, where the pins live: a plain
        function would run on a worker thread."""
        self.pins.renew(UNCLAIMED, [request_id])

    def claim(self, request_id: str, transfer_id: str, *, owner: str, readers_per_rank: list[int]) -> Manifest:
        """Hand the pinned request to decode engine `owner`; its manifest, with the lease renewed."""
        manifest = self._unclaimed.get(transfer_id)
        pin = None if manifest is None else self.pins.claim(request_id, transfer_id, owner, readers_per_rank)
        if manifest is None or pin is None:
            raise FailedPrecondition(
                f"no prefilled state of request {request_id!r} (transfer {transfer_id!r}) waits for a decode engine "
                f"here: its lease ran out ({self.pins.lease_seconds:g}s after the prefill leg answered), it was "
                "claimed already, or it was never prefilled by this incarnation",
                field="kv_transfer_params.remote_request_id",
                reason="LEASE_EXPIRED",
            )
        del self._unclaimed[transfer_id]
        pin.on_end = None
        lease = pin.lease_left()
        return dataclasses.replace(manifest, lease_ns=lease.ns, lease_expire_time_ns=lease.expire_time_ns)

    def give_up(self, request_id: str, transfer_id: str) -> bool:
        """A decode engine failed the decode leg before its claim (its params did not match this
        engine, its cache stayed full, its deadline passed): free the pin now, not at the end of
        its lease. Only with both ids the prefill leg answered (False: no such unclaimed pin)."""
        pin = self.pins.lookup(UNCLAIMED, request_id)
        if pin is None or pin.transfer_id != transfer_id or transfer_id not in self._unclaimed:
            return False
        return self.pins.release(pin, "released")

    def _ended(self, transfer_id: str, reason: str) -> None:
        self._unclaimed.pop(transfer_id, None)
