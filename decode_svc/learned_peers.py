"""The decode leg of vLLM's P/D protocol: the prefill engine a request's kv_transfer_params name.

`remote_host:remote_port` is the prefill engine's gRPC address. On first sight it is handshaken
like a configured peer (layout checked field by field, link, probe READ, Session), then cached
for the requests that follow; it makes one attempt and is forgotten when it fails or its session
ends (decode_svc/prefill_peer.py, `once`), so a dead prefill leaves nothing behind. A configured
peer (`--prefill`) that is the same engine serves the request itself: one link per remote engine.

What the params say is checked against what the engine said at its handshake (engine id,
incarnation, TP size, groups, block range) before anything is claimed, and against the claimed
manifest after (blocks, prompt length, boundary); every mismatch names its field. A decode leg
that fails before its claim (those checks, a full cache, its deadline) gives the pin up on the
engine at once if it is reachable (`give_up`), instead of leaving it to its lease.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from decode_svc.peer_link import PeerLink
from decode_svc.prefill_peer import PrefillPeer, PrefillPeers
from decode_svc.session_client import OPEN_TIMEOUT_SECONDS
from shared.cache.manifest import Manifest
from shared.errors import FailedPrecondition, InvalidArgument, Unavailable
from shared.http.kv_transfer import (
    EXTRA,
    ROOT,
    PrefillGroups,
    RemotePrefill,
    check_blocks,
    parse_remote_prefill,
    wants_remote_prefill,
)
from shared.pb.hybridpd.v1 import layout_pb2
from shared.rpc.channel import HANDSHAKE_TIMEOUT_SECONDS

# The first request naming a prefill engine waits this long for its handshake, link and session.
CONNECT_WAIT_SECONDS = HANDSHAKE_TIMEOUT_SECONDS + OPEN_TIMEOUT_SECONDS + 5.0


def remote_prefill_of(kv_transfer_params: str) -> RemotePrefill | None:
    """The decode leg's instructions from GenerateRequest.kv_transfer_params (JSON), or None when
    the request is not a decode leg (empty, or `do_remote_prefill` not true)."""
    if not kv_transfer_params:
        return None
    try:
        params = json.loads(kv_transfer_params)
    except ValueError as e:
        raise InvalidArgument(f"is not valid JSON: {e}", field=ROOT) from None
    if not isinstance(params, dict):
        raise InvalidArgument(f"must be a JSON object, got {type(params).__name__}", field=ROOT)
    if not wants_remote_prefill(params):
        return None
    remote = parse_remote_prefill(params)
    if remote.transfer_id is None:
        raise InvalidArgument(
            "is required: this decode engine reads state prefilled by a hybrid-pd prefill engine, whose answer "
            f"carries it (the {EXTRA} object a router passes through unchanged)",
            field=f"{ROOT}.{EXTRA}.transfer_id",
        )
    return remote


def check_link(remote: RemotePrefill, link: PeerLink) -> None:
    """The params against what the named engine said at its handshake."""
    layout = link.remote
    if layout.engine_id != remote.engine_id:
        raise FailedPrecondition(
            f"{remote.grpc_target} is prefill engine {layout.engine_id!r}, not {remote.engine_id!r}",
            field=f"{ROOT}.remote_engine_id",
            reason="UNKNOWN_PREFILL_ENGINE",
        )
    if remote.incarnation is not None and remote.incarnation != f"{layout.incarnation:016x}":
        raise FailedPrecondition(
            f"prefill {remote.engine_id} restarted (incarnation {layout.incarnation:016x}, the params name "
            f"{remote.incarnation}): the state they describe is gone",
            field=f"{ROOT}.{EXTRA}.incarnation",
            reason="PREFILL_RESTARTED",
        )
    if remote.tp_size != layout.tp_size:
        raise InvalidArgument(
            f"{remote.tp_size}, but prefill {remote.engine_id} runs {layout.tp_size} ranks", field=f"{ROOT}.tp_size"
        )
    names = [layout_pb2.GroupKind.Name(g.kind) for g in layout.groups]
    check_blocks(remote, PrefillGroups(layout.num_logical_blocks, names))


def check_claimed(remote: RemotePrefill, manifest: Manifest, prompt_tokens: int, computed: int, prompt_field: str) -> None:
    """The claimed state is the one the params describe, for this request's prompt."""
    blocks = tuple(tuple(int(b) for b in ids) for ids in manifest.block_ids)
    if blocks != remote.block_ids:
        raise FailedPrecondition(
            f"prefill {remote.engine_id} holds request {remote.request_id} in blocks {[list(b) for b in blocks]}, "
            "not the ones named",
            field=f"{ROOT}.remote_block_ids",
            reason="BLOCKS_MISMATCH",
        )
    if manifest.prompt_token_count != prompt_tokens:
        raise InvalidArgument(
            f"{prompt_tokens} tokens, but prefill {remote.engine_id} computed the state of a "
            f"{manifest.prompt_token_count}-token prompt (send the decode leg the prefill leg's prompt)",
            field=prompt_field,
        )
    if manifest.num_computed_tokens != computed:
        raise FailedPrecondition(
            f"prefill {remote.engine_id} computed {manifest.num_computed_tokens} tokens of the state; this decode "
            f"engine continues from {computed}",
            field=f"{ROOT}.{EXTRA}.num_computed_tokens",
            reason="BOUNDARY_MISMATCH",
        )


class LearnedPeers:
    def __init__(self, configured: PrefillPeers, factory: Callable[[str], PrefillPeer]) -> None:
        self.configured = configured
        self.factory = factory  # a one-attempt PrefillPeer for a target
        self.peers: dict[str, PrefillPeer] = {}  # by target

    @property
    def remote_agents(self) -> int:
        return sum(len(p.link.added) for p in self.peers.values() if p.link is not None and not p.link.closed)

    async def peer_for(self, remote: RemotePrefill) -> PrefillPeer:
        """A ready peer for the engine the params name (handshaken now if new), params checked."""
        peer = self._configured(remote)
        if peer is None:
            peer = self._learned(remote.grpc_target)
            try:
                async with asyncio.timeout(CONNECT_WAIT_SECONDS):
                    await peer.settled.wait()
            except TimeoutError:
                pass
            if not peer.ready:
                raise Unavailable(
                    f"prefill {remote.engine_id} at {remote.grpc_target} is not reachable: "
                    f"{peer.last_error or 'no handshake within ' + format(CONNECT_WAIT_SECONDS, 'g') + 's'}",
                    field=f"{ROOT}.remote_host",
                    reason="PEER_UNAVAILABLE",
                )
        assert peer.link is not None
        check_link(remote, peer.link)
        return peer

    def give_up(self, remote: RemotePrefill, reason: str) -> bool:
        """The decode leg failed before its claim: free its pin on prefill now where the engine is
        reachable (a ready session to it); elsewhere its lease frees it. Whether it was sent."""
        peer = self._configured(remote) or self.peers.get(remote.grpc_target)
        if peer is None or not peer.ready or peer.session is None or remote.transfer_id is None:
            return False
        peer.session.give_up(remote.request_id, remote.transfer_id, reason)
        return True

    def _configured(self, remote: RemotePrefill) -> PrefillPeer | None:
        """A ready configured peer (`--prefill`) that is the engine the params name."""
        return next(
            (p for p in self.configured.peers if p.ready and p.link is not None and p.link.engine_id == remote.engine_id),
            None,
        )

    def _learned(self, target: str) -> PrefillPeer:
        peer = self.peers.get(target)
        if peer is None:
            peer = self.peers[target] = self.factory(target)
            peer.start().add_done_callback(lambda _: self._forget(peer))
        return peer

    def _forget(self, peer: PrefillPeer) -> None:
        if self.peers.get(peer.target) is peer:
            del self.peers[peer.target]

    async def aclose(self) -> None:
        await asyncio.gather(*(p.aclose() for p in list(self.peers.values())))
        self.peers.clear()
