"""Transport failures, each naming the peer so an operator knows which side to look at.

NIXL raises one exception class per status with no common base; these wrap them so
callers catch one family and services can map them to gRPC statuses.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """A NIXL operation failed; `peer` is the remote agent involved ("" if none)."""

    def __init__(self, message: str, *, peer: str = "", nixl_error: str = "") -> None:
        super().__init__(message)
        self.peer = peer
        self.nixl_error = nixl_error


class TransferFailed(TransportError):
    """A READ ended with an error (peer died, descriptors refused, ...)."""


class TransferTimedOut(TransportError):
    """A READ did not finish before its deadline (e.g. a frozen peer); its handle is released
    after (see Xfer.release_done)."""


class PeerDisconnected(TransferFailed):
    """The peer died or the connection was lost during a READ (nixlRemoteDisconnectError)."""


class PeerMetadataRejected(TransportError):
    """NIXL could not load a peer's agent metadata (not NIXL metadata, or this agent's own)."""


class PeerAlreadyKnown(TransportError):
    """A peer with this agent name but different connection info is loaded: remove it first."""
