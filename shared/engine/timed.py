"""An engine call with the seconds it took, measured where it runs (the compute thread): the
engine's own time, without the hops to and from that thread or queueing behind other work."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """`fn(*args)` and the seconds it took."""
    began = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - began
