"""PrefillPeers: pick() takes the least loaded ready peer (ties round-robin, not-ready peers
never); a retiring peer leaves the rotation at once but its address stays known until closed."""

from __future__ import annotations

import asyncio
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


class Draining(StandIn):
    """Test-only stand-in whose retirement lasts until the test lets it end."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.done = asyncio.Event()

    async def retire(self) -> None:
        self.ready = False
        await self.done.wait()

    def on_state_change(self) -> None:
        pass


@pytest.mark.asyncio
async def test_a_retiring_address_stays_known_until_closed() -> None:
    old = Draining("10.0.0.1:1")
    peers = pool(old, StandIn("10.0.0.2:1"))
    peers.retire("10.0.0.1:1")
    assert [p.target for p in peers.peers] == ["10.0.0.2:1"]  # out of the rotation at once
    assert peers.targets() == {"10.0.0.1:1", "10.0.0.2:1"}  # but not re-added while it drains
    peers.retire("10.0.0.1:1")  # retiring it again does nothing
    assert peers.retiring == [old]
    old.done.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert peers.retiring == [] and peers.targets() == {"10.0.0.2:1"}
