"""How long a service may wait on a caller's behalf (for free cache blocks, a stream credit)
so that its refusal still reaches the caller before the caller's own deadline does.

Without a margin the caller's deadline fires first and the caller sees DEADLINE_EXCEEDED
instead of the status that says what happened (RESOURCE_EXHAUSTED: the cache stayed full).
"""

from __future__ import annotations

REPLY_MARGIN_MAX_SECONDS = 0.25
REPLY_MARGIN_FRACTION = 0.1


def wait_deadline(deadline: float, now: float) -> float:
    """The moment to stop waiting (same clock as `deadline`): a little before `deadline`."""
    left = max(0.0, deadline - now)
    return deadline - min(REPLY_MARGIN_MAX_SECONDS, REPLY_MARGIN_FRACTION * left)
