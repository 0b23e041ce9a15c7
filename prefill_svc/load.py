"""What this prefill engine tells each decode engine about its load, in `SessionReady` and every
heartbeat: blocks held by pins (every decode engine's) and the jobs of the *other* sessions.
A session's own jobs are left out because its decode engine counts those exactly, without the
lag of a heartbeat interval; decode adds the two (decode_svc/prefill_load.py)."""

from __future__ import annotations

from collections import Counter

from prefill_svc.pins import PinTable
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb


class LoadBoard:
    def __init__(self, pins: PinTable) -> None:
        self.pins = pins
        self._jobs: Counter[str] = Counter()  # jobs computing or waiting, by session owner

    def job_started(self, owner: str) -> None:
        self._jobs[owner] += 1

    def job_ended(self, owner: str) -> None:
        self._jobs[owner] -= 1
        if self._jobs[owner] <= 0:
            del self._jobs[owner]

    def jobs(self) -> int:
        return sum(self._jobs.values())

    def report(self, owner: str) -> pb.PrefillLoad:
        """The load as the session of `owner` is told it."""
        return pb.PrefillLoad(pinned_blocks=self.pins.blocks(), other_jobs=self.jobs() - self._jobs[owner])
