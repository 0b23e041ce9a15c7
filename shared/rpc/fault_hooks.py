"""TRANSITIONAL: the fault seam (shared/runtime/faults.py) under the names prefill_svc/jobs.py and
decode_svc/generation.py still call. Delete this file once they call `shared.runtime.faults`."""

from __future__ import annotations

from shared.errors import ServiceError
from shared.runtime import faults

pause = faults.pause
pauses_at = faults.holds


def failure_for(request_id: str) -> ServiceError | None:
    return faults.failure(request_id)


def corruption_for(request_id: str) -> str | None:
    injector = faults.active()
    return None if injector is None else injector.corruption(request_id)
