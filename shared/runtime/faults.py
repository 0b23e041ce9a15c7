"""The one seam for fault injection (TEST-ONLY): named points on a request's path where a test
can pause it, fail it, corrupt its state or watch it, so fault tests strike at an exact point of
its life (a real SIGKILL has to land between two steps that take microseconds).

Nothing is installed in production: every point below is then a no-op, and no fault code runs.
A test installs an `Injector` (in process: the `inject_faults` fixture of tests/conftest.py), or
starts a service process with the TEST-ONLY environment variables that `FaultPlan` reads:

- `HYBRID_PD_TEST_PAUSE`: comma-separated `STEP:SECONDS[:REQUEST_ID_PREFIX]`, e.g.
  `before_read:2:victim-` pauses decode for 2 s before the READ of every request whose id starts
  with `victim-`. Each pause logs `TEST PAUSE <step> <request id> <seconds>s` at WARNING (stderr),
  so a test that watches the output knows when to strike.
- `HYBRID_PD_TEST_CORRUPT`: `SECTION[:REQUEST_ID_PREFIX]` with SECTION one of fa, conv, ssm:
  prefill flips one byte of that section in a request's blocks right after taking its digests,
  as memory corrupted between the write and the READ would be.
- `HYBRID_PD_TEST_FAIL`: `STATUS[:REQUEST_ID_PREFIX]` with STATUS a gRPC status name, e.g.
  `RESOURCE_EXHAUSTED:victim-`: prefill fails each such job at `before_manifest` with that
  status, as a job that ran out of capacity would.

The points (`pause` steps; the others are functions of their own):
- `before_manifest` (prefill): the state is computed, nothing is pinned, no manifest sent yet;
  `failure` is asked here too;
- `between_parts` (prefill, pipelined transfer): a manifest part has just left, the next chunk
  has not started (`holds` says beforehand whether a pause will come);
- `before_read` (decode): the manifest is in hand, local blocks allocated, no READ posted;
- `after_read` (decode): the state is read (or restored from a state checkpoint), decoding has
  not started;
- `digested` (prefill): a request's (or a part's) digests were just taken;
- `manifest_delivered` (decode): a manifest was just handed to the job that waits for it;
- `part_left` (prefill, pipelined transfer): manifest part `index` (not the last) has just left.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from shared.engine.protocol import RequestBlocks
from shared.errors import ERRORS_BY_STATUS, ServiceError, error_for_status
from shared.runtime.engine_host import EngineHost

log = logging.getLogger(__name__)

STEPS = ("before_manifest", "between_parts", "before_read", "after_read")
CORRUPTIBLE = ("fa", "conv", "ssm")
PAUSE_ENV_VAR = "HYBRID_PD_TEST_PAUSE"
CORRUPT_ENV_VAR = "HYBRID_PD_TEST_CORRUPT"
FAIL_ENV_VAR = "HYBRID_PD_TEST_FAIL"


class Injector:
    """What a test installs. Every method here does nothing: a test overrides those it needs."""

    async def pause(self, step: str, request_id: str) -> None:
        """Hold the request at `step` (cancellable, like any await)."""

    def holds(self, step: str, request_id: str) -> bool:
        """Whether `pause(step, request_id)` will hold the request."""
        return False

    def failure(self, request_id: str) -> ServiceError | None:
        """The error to fail this prefill job with at `before_manifest` (None: let it run)."""
        return None

    def corruption(self, request_id: str) -> str | None:
        """The section (fa, conv, ssm) to corrupt in this request's state after its digests."""
        return None

    def manifest_delivered(self, request_id: str) -> None:
        """Called in the event-loop turn a manifest reached the job waiting for it."""

    async def part_left(self, request_id: str, index: int) -> None:
        """Awaited after manifest part `index` (not the last) left, after `between_parts`'s
        pause, before the next span is queued when `holds("between_parts", ...)`."""

    def describe(self) -> str:
        return type(self).__name__


_active: Injector | None = None


def install(injector: Injector | None) -> None:
    """Make `injector` the one in force (None: no fault injection, as in production)."""
    global _active
    _active = injector


def active() -> Injector | None:
    return _active


def warn_if_active() -> None:
    """Say loudly at start-up that this process runs with injected faults."""
    if _active is not None:
        log.warning("TEST-ONLY fault injection is on: %s", _active.describe())


# ---- the points production calls: each a no-op while nothing is installed ----


async def pause(step: str, request_id: str) -> None:
    if _active is not None:
        await _active.pause(step, request_id)


def holds(step: str, request_id: str) -> bool:
    return _active is not None and _active.holds(step, request_id)


def failure(request_id: str) -> ServiceError | None:
    return None if _active is None else _active.failure(request_id)


def manifest_delivered(request_id: str) -> None:
    if _active is not None:
        _active.manifest_delivered(request_id)


async def part_left(request_id: str, index: int) -> None:
    if _active is not None:
        await _active.part_left(request_id, index)


def corrupts(request_id: str) -> bool:
    """Whether the injector flips a byte of this request's state (nothing of it may be kept)."""
    return _active is not None and _active.corruption(request_id) is not None


def digested(
    host: EngineHost, blocks: RequestBlocks, request_id: str, first_token: int, *, last: bool = True, layers: range | None = None
) -> None:
    """After a request's digests (a part's: `last` False but for the last part, `layers` for a
    layer part): flip the byte the injector asks for, where that READ moves it (fa: of token
    `first_token`, the first the READ moves; conv and SSM: with the last part only)."""
    section = None if _active is None else _active.corruption(request_id)
    if section is None or not (last or section == "fa"):
        return
    if layers is None or _corrupted_layer(host, section) in layers:
        _flip_one_byte(host, blocks, section, first_token)


def _corrupted_layer(host: EngineHost, section: str) -> int:
    """The model layer whose byte `_flip_one_byte` flips for `section`."""
    kind = "attention" if section == "fa" else "mamba"
    return next(grp.layers[0] for grp in host.layout.groups if grp.kind == kind)


def _flip_one_byte(host: EngineHost, blocks: RequestBlocks, section: str, first_token: int = 0) -> None:
    """Flip the first byte of `section` that rank 0 holds for this request in the first group of
    its kind (fa: of token `first_token`)."""
    layout, views = host.layout, host.views[0]
    kind = "attention" if section == "fa" else "mamba"
    group = next(g for g, grp in enumerate(layout.groups) if grp.kind == kind)
    ids = np.asarray(blocks.block_ids[group])
    if section == "fa":
        kernel, slot = layout.token_slots(ids, [first_token])
        target: torch.Tensor = views.fa[0][int(kernel[0]), 0, 0, int(slot[0])]
    else:
        target = (views.conv if section == "conv" else views.ssm)[0][int(ids[0])].reshape(-1)
    raw = target.view(torch.uint8)
    raw[0] = raw[0] ^ 0x01


# ---- the injector the TEST-ONLY environment variables describe ----


@dataclass(frozen=True)
class Pause:
    step: str
    seconds: float
    request_prefix: str = ""


def parse_pauses(text: str) -> tuple[Pause, ...]:
    pauses: list[Pause] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        fields = item.split(":", 2)
        if len(fields) < 2 or fields[0] not in STEPS:
            raise ValueError(f"{PAUSE_ENV_VAR}: {item!r} is not STEP:SECONDS[:PREFIX] with STEP one of {', '.join(STEPS)}")
        pauses.append(Pause(fields[0], float(fields[1]), fields[2] if len(fields) == 3 else ""))
    return tuple(pauses)


@dataclass(frozen=True)
class FaultPlan(Injector):
    """Pauses, a section to corrupt and a status to fail with, each for the requests whose id
    starts with a prefix (the formats above)."""

    pauses: tuple[Pause, ...] = ()
    corrupt: str = ""  # SECTION[:PREFIX]
    fail: str = ""  # STATUS[:PREFIX]

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultPlan | None:
        """The plan the environment sets, None where it sets none."""
        plan = cls(parse_pauses(environ.get(PAUSE_ENV_VAR, "")), environ.get(CORRUPT_ENV_VAR, ""), environ.get(FAIL_ENV_VAR, ""))
        return plan if plan != cls() else None

    async def pause(self, step: str, request_id: str) -> None:
        for p in self.pauses:
            if p.step == step and request_id.startswith(p.request_prefix):
                log.warning("TEST PAUSE %s %s %.3gs", step, request_id, p.seconds)
                await asyncio.sleep(p.seconds)
                log.warning("TEST PAUSE %s %s over", step, request_id)

    def holds(self, step: str, request_id: str) -> bool:
        return any(p.step == step and request_id.startswith(p.request_prefix) for p in self.pauses)

    def failure(self, request_id: str) -> ServiceError | None:
        if not self.fail:
            return None
        status, _, prefix = self.fail.partition(":")
        if status not in ERRORS_BY_STATUS:
            raise ValueError(f"{FAIL_ENV_VAR}: {self.fail!r} is not STATUS[:PREFIX] with STATUS a gRPC status name")
        if not request_id.startswith(prefix):
            return None
        return error_for_status(status, f"TEST-ONLY failure of job {request_id} before its manifest ({FAIL_ENV_VAR})")

    def corruption(self, request_id: str) -> str | None:
        if not self.corrupt:
            return None
        section, _, prefix = self.corrupt.partition(":")
        if section not in CORRUPTIBLE:
            raise ValueError(
                f"{CORRUPT_ENV_VAR}: {self.corrupt!r} is not SECTION[:PREFIX] with SECTION one of {', '.join(CORRUPTIBLE)}"
            )
        return section if request_id.startswith(prefix) else None

    def describe(self) -> str:
        pauses = ", ".join(f"{p.step} {p.seconds:g}s {p.request_prefix!r}" for p in self.pauses)
        return f"pauses [{pauses}], corrupt {self.corrupt!r}, fail {self.fail!r}"


# A service process started with the variables set runs with their plan from its first request.
install(FaultPlan.from_env(os.environ))
