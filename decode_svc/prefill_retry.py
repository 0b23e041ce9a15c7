"""A request's prefill job, sent again to another prefill engine when the chosen one fails it
before its manifest.

Before the manifest nothing is pinned for us anywhere and our own blocks hold nothing yet, so
sending the same job elsewhere is safe. Retried: the session was lost or the peer drains
(UNAVAILABLE), or it had no capacity for the job (RESOURCE_EXHAUSTED); each other ready peer is
tried at most once, and only while the client's deadline has not passed. Anything else (a bad
prompt, the deadline) would fail the same way anywhere and is raised as it came. After the
manifest arrived there is no retry: the READ path fails as before. A P/D decode leg, whose
kv_transfer_params name the prefill engine that holds its state, never comes here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from decode_svc.prefill_peer import PrefillPeer, PrefillPeers
from shared.errors import ServiceError
from shared.telemetry import PREFILL_RETRY_REASONS

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRIED_STATUSES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")


def retry_reason(error: ServiceError) -> str | None:
    """The label a failure before the manifest is retried under; None: not retried."""
    if error.status not in RETRIED_STATUSES:
        return None
    # The label of hybrid_pd_prefill_retries_total: the ErrorInfo reason when it has its own, else the status.
    return error.reason if error.reason in PREFILL_RETRY_REASONS else error.status


async def on_some_prefill(
    peers: PrefillPeers,
    first: PrefillPeer,
    attempt: Callable[[PrefillPeer], Awaitable[T]],
    deadline: float,
    on_retry: Callable[[str], None] = lambda reason: None,
    retryable: Callable[[], bool] = lambda: True,
) -> T:
    """`attempt(first)`; when it fails before the manifest with a retried status, `attempt` on
    the least loaded ready peer not tried yet, and so on. The last failure is raised as it came
    when no peer is left, the deadline (event-loop time) has passed, or `retryable()` is False
    (a manifest part arrived: our blocks may hold part of the state, READs may be in flight)."""
    loop = asyncio.get_running_loop()
    tried: list[PrefillPeer] = []
    peer = first
    while True:
        try:
            return await attempt(peer)
        except ServiceError as e:
            tried.append(peer)
            reason = retry_reason(e)
            if reason is None or loop.time() >= deadline or not retryable():
                raise
            other = peers.pick_other(tried)
            if other is None:
                raise
            log.warning("prefill %s failed the job before its manifest (%s): sending it to %s", peer.name, e.message, other.name)
            on_retry(reason)
            peer = other
