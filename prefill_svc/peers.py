"""Decode engines that completed a handshake with this prefill engine, and their open sessions."""

from __future__ import annotations

from dataclasses import dataclass

from shared.pb.hybridpd.v1 import layout_pb2 as pb


@dataclass(frozen=True, eq=False)
class DecodePeer:
    engine_id: str
    incarnation: int
    layout: pb.EngineLayout

    @property
    def key(self) -> str:
        """Owner key of this incarnation's pinned requests: a restarted decode engine (same id,
        new incarnation) never renews, releases or collides with what its previous life pinned."""
        return f"{self.engine_id}/{self.incarnation:016x}"


class DecodePeers:
    """The latest handshaken incarnation of each decode engine (an older one is forgotten).

    A peer is forgotten when its last session ends: a decode engine handshakes again before it
    opens its next session, so nothing about a dead decode engine stays behind (its pinned
    requests end with their leases).
    """

    def __init__(self) -> None:
        self._peers: dict[str, DecodePeer] = {}
        self._sessions: dict[str, int] = {}  # open sessions per peer key

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def open_sessions(self) -> int:
        return sum(self._sessions.values())

    def add(self, layout: pb.EngineLayout) -> DecodePeer:
        peer = DecodePeer(layout.engine_id, layout.incarnation, layout)
        self._peers[peer.engine_id] = peer
        return peer

    def get(self, engine_id: str, incarnation: int) -> DecodePeer | None:
        peer = self._peers.get(engine_id)
        return peer if peer is not None and peer.incarnation == incarnation else None

    def session_opened(self, peer: DecodePeer) -> None:
        self._sessions[peer.key] = self._sessions.get(peer.key, 0) + 1

    def session_closed(self, peer: DecodePeer) -> None:
        left = self._sessions.get(peer.key, 0) - 1
        if left > 0:
            self._sessions[peer.key] = left
            return
        self._sessions.pop(peer.key, None)
        # Identity: a handshake after this session opened (a reconnect) made a new entry; keep it.
        if self._peers.get(peer.engine_id) is peer:
            del self._peers[peer.engine_id]
