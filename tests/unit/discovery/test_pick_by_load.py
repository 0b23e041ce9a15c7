"""PrefillPeers.pick: the least loaded ready peer, ties round-robin, not-ready peers never."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

from decode_svc.prefill_peer import PrefillPeers
from shared.errors import Unavailable
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb


@dataclass
class StandIn:
    """Test-only stand-in for a PrefillPeer: just what pick() reads."""

    target: str
    ready: bool = True
    load: int = 0
    state: int = dpb.PEER_STATE_READY
    last_error: str = ""


def pool(*peers: StandIn) -> PrefillPeers:
    return PrefillPeers(cast(Any, list(peers)))


def test_idle_pool_alternates() -> None:
    peers = pool(StandIn("a"), StandIn("b"), StandIn("c"))
    assert [peers.pick().target for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_wins_and_ties_rotate() -> None:
    a, b, c = StandIn("a", load=3), StandIn("b", load=1), StandIn("c", load=1)
    peers = pool(a, b, c)
    assert peers.pick().target == "b"
    assert peers.pick().target == "c"  # tie with b: the next in turn
    b.load = 5
    assert peers.pick().target == "c"
    c.load = 9
    assert peers.pick().target == "a"


def test_not_ready_peers_are_skipped_even_when_idle() -> None:
    peers = pool(StandIn("a", ready=False), StandIn("b", load=7))
    assert peers.pick().target == "b"
    with pytest.raises(Unavailable, match="no prefill engine is ready"):
        pool(StandIn("a", ready=False, state=dpb.PEER_STATE_FAILED, last_error="down")).pick()
