"""Decode engines that completed a handshake with this prefill engine."""

from __future__ import annotations

from dataclasses import dataclass

from shared.pb.hybridpd.v1 import layout_pb2 as pb


@dataclass(frozen=True)
class DecodePeer:
    engine_id: str
    incarnation: int
    layout: pb.EngineLayout


class DecodePeers:
    """The latest handshaken incarnation of each decode engine (an older one is forgotten)."""

    def __init__(self) -> None:
        self._peers: dict[str, DecodePeer] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def add(self, layout: pb.EngineLayout) -> DecodePeer:
        peer = DecodePeer(layout.engine_id, layout.incarnation, layout)
        self._peers[peer.engine_id] = peer
        return peer

    def get(self, engine_id: str, incarnation: int) -> DecodePeer | None:
        peer = self._peers.get(engine_id)
        return peer if peer is not None and peer.incarnation == incarnation else None
