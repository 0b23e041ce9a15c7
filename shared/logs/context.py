"""The request a log line belongs to, in contextvars: set once where a request (or a prefill job)
starts, read by the formatters, so every line logged while serving it names it.

Each gRPC call, HTTP request and prefill job runs in its own asyncio task, and a task copies the
context at creation: a value set in one request never leaks into another."""

from __future__ import annotations

from contextvars import ContextVar

request_id: ContextVar[str] = ContextVar("hybrid_pd_request_id", default="")
peer: ContextVar[str] = ContextVar("hybrid_pd_peer", default="")


def bind_request(rid: str, remote: str = "") -> None:
    """Name the request (and the peer it came from) for the rest of this task."""
    request_id.set(rid)
    if remote:
        peer.set(remote)
