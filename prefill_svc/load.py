"""What this prefill engine tells each decode engine about its load, in `SessionReady` and every
heartbeat: blocks held by pins (every decode engine's) and the jobs of the *other* sessions,
with the prompt tokens they compute.
A session's own jobs are left out because its decode engine counts those exactly, without the
lag of a heartbeat interval; decode adds the two (decode_svc/prefill_load.py)."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb


class PinnedBlocks(Protocol):
    """The pin table (prefill_svc/pins.py), as far as the load is concerned."""

    def blocks(self) -> int: ...


class LoadBoard:
    def __init__(self, pins: PinnedBlocks) -> None:
        self.pins = pins
        self._jobs: Counter[str] = Counter()  # jobs computing or waiting, by session owner
        self._tokens: Counter[str] = Counter()  # the prompt tokens those jobs compute, by session owner

    def job_started(self, owner: str, tokens: int) -> None:
        self._jobs[owner] += 1
        self._tokens[owner] += tokens

    def job_ended(self, owner: str, tokens: int) -> None:
        self._jobs[owner] -= 1
        self._tokens[owner] -= tokens
        if self._jobs[owner] <= 0:
            del self._jobs[owner]
            del self._tokens[owner]

    def jobs(self) -> int:
        return sum(self._jobs.values())

    def prompt_tokens(self) -> int:
        return sum(self._tokens.values())

    def report(self, owner: str) -> pb.PrefillLoad:
        """The load as the session of `owner` is told it."""
        return pb.PrefillLoad(
            pinned_blocks=self.pins.blocks(),
            other_jobs=self.jobs() - self._jobs[owner],
            other_prompt_tokens=self.prompt_tokens() - self._tokens[owner],
        )
