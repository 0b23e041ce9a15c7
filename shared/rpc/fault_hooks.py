"""TEST-ONLY pauses at named steps of a request, so fault tests can kill or freeze a peer at an
exact point of its life (a real SIGKILL has to land between two steps that take microseconds).

Only tests set `HYBRID_PD_TEST_PAUSE`; it is not a service flag and is unset in production,
where `pause()` returns at once. Format: comma-separated `STEP:SECONDS[:REQUEST_ID_PREFIX]`,
e.g. `before_read:2:victim-` pauses decode for 2 s before the READ of every request whose id
starts with `victim-`. Steps:
- `before_manifest` (prefill): the state is computed, nothing is pinned, no manifest sent yet;
- `between_parts` (prefill, pipelined transfer): a manifest part has just left, the next chunk
  has not started;
- `before_read` (decode): the manifest is in hand, local blocks allocated, no READ posted;
- `after_read` (decode): the state is read (or restored from a state checkpoint), decoding has
  not started.
Each pause logs `TEST PAUSE <step> <request id> <seconds>s` at WARNING (stderr), so a test that
watches the output knows when to strike.

`HYBRID_PD_TEST_CORRUPT` (TEST-ONLY too): `SECTION[:REQUEST_ID_PREFIX]` with SECTION one of fa,
conv, ssm: prefill flips one byte of that section in a request's blocks right after taking its
digests, as memory corrupted between the write and the READ would be.

`HYBRID_PD_TEST_FAIL` (TEST-ONLY too): `STATUS[:REQUEST_ID_PREFIX]` with STATUS a gRPC status
name, e.g. `RESOURCE_EXHAUSTED:victim-`: prefill fails each such job at `before_manifest` (the
state is computed, nothing pinned) with that status, as a job that ran out of capacity would.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

from shared.errors import ERRORS_BY_STATUS, ServiceError, error_for_status

log = logging.getLogger(__name__)

ENV_VAR = "HYBRID_PD_TEST_PAUSE"
STEPS = ("before_manifest", "between_parts", "before_read", "after_read")


@dataclass(frozen=True)
class Pause:
    step: str
    seconds: float
    request_prefix: str = ""


def parse(text: str) -> list[Pause]:
    pauses: list[Pause] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        fields = item.split(":", 2)
        if len(fields) < 2 or fields[0] not in STEPS:
            raise ValueError(f"{ENV_VAR}: {item!r} is not STEP:SECONDS[:PREFIX] with STEP one of {', '.join(STEPS)}")
        pauses.append(Pause(fields[0], float(fields[1]), fields[2] if len(fields) == 3 else ""))
    return pauses


_PAUSES: list[Pause] = parse(os.environ.get(ENV_VAR, ""))
CORRUPT_ENV_VAR = "HYBRID_PD_TEST_CORRUPT"
CORRUPTIBLE = ("fa", "conv", "ssm")


def corruption_for(request_id: str, spec: str | None = None) -> str | None:
    """The section to corrupt for this request after its digests (None: leave it alone)."""
    text = os.environ.get(CORRUPT_ENV_VAR, "") if spec is None else spec
    if not text:
        return None
    section, _, prefix = text.partition(":")
    if section not in CORRUPTIBLE:
        raise ValueError(f"{CORRUPT_ENV_VAR}: {text!r} is not SECTION[:PREFIX] with SECTION one of {', '.join(CORRUPTIBLE)}")
    return section if request_id.startswith(prefix) else None


FAIL_ENV_VAR = "HYBRID_PD_TEST_FAIL"


# Read once, as the pauses are: the variable is set when a service process starts, and every job asks.
_FAIL: str = os.environ.get(FAIL_ENV_VAR, "")


def failure_for(request_id: str, spec: str | None = None) -> ServiceError | None:
    """The error to fail this job with before its manifest (None: let it run)."""
    text = _FAIL if spec is None else spec
    if not text:
        return None
    status, _, prefix = text.partition(":")
    if status not in ERRORS_BY_STATUS:
        raise ValueError(f"{FAIL_ENV_VAR}: {text!r} is not STATUS[:PREFIX] with STATUS a gRPC status name")
    if not request_id.startswith(prefix):
        return None
    return error_for_status(status, f"TEST-ONLY failure of job {request_id} before its manifest ({FAIL_ENV_VAR})")


def warn_if_active() -> None:
    """Say loudly at start-up that this process runs with test pauses."""
    if os.environ.get(FAIL_ENV_VAR):
        log.warning("%s is set: TEST-ONLY job failures %r before the manifest", FAIL_ENV_VAR, os.environ[FAIL_ENV_VAR])
    if os.environ.get(CORRUPT_ENV_VAR):
        log.warning("%s is set: TEST-ONLY corruption of %r after digests", CORRUPT_ENV_VAR, os.environ[CORRUPT_ENV_VAR])
    if _PAUSES:
        log.warning(
            "%s is set: TEST-ONLY pauses %s", ENV_VAR, ", ".join(f"{p.step} {p.seconds:g}s {p.request_prefix!r}" for p in _PAUSES)
        )


def pauses_at(step: str, request_id: str) -> bool:
    """Whether a test asked for a pause at `step` for this request."""
    return any(p.step == step and request_id.startswith(p.request_prefix) for p in _PAUSES)


async def pause(step: str, request_id: str) -> None:
    """Sleep if a test asked for a pause at `step` for this request (cancellable, like any await)."""
    for p in _PAUSES:
        if p.step == step and request_id.startswith(p.request_prefix):
            log.warning("TEST PAUSE %s %s %.3gs", step, request_id, p.seconds)
            await asyncio.sleep(p.seconds)
            log.warning("TEST PAUSE %s %s over", step, request_id)
