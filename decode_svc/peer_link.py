"""What decode keeps per handshaken prefill engine: remote agents added, the transfer plan, and
the local and remote descriptor lists prepared once per (decode rank, prefill rank) pair.

Built once per prefill incarnation, after a probe READ proved the data path works, and closed
as soon as its session is lost: closing waits until no request is reading through it any more
(their READs are cancelled with the session), then releases the prepared lists and removes
the remote agents. So a restarted prefill's old agents are gone before its new ones are added,
and no READ can ever target the memory of an old incarnation (`reading()` refuses a closing link).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from shared.cache.id_buffers import IdBufferPool
from shared.cache.memory_place import MemoryPlace
from shared.errors import InvalidArgument, Unavailable
from shared.layout.plan import TransferPlan
from shared.layout.read_lists import ReadLists, build_read_lists, read_indices
from shared.pb.hybridpd.v1 import layout_pb2 as pb
from shared.rpc.compat import check_pair
from shared.rpc.manifest_message import ManifestSource
from shared.runtime.engine_host import EngineHost
from shared.transport.agent import PreppedList
from shared.transport.errors import PeerAlreadyKnown, PeerMetadataRejected, TransportError
from shared.transport.read_fence import ReadFence

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PairLists:
    """One (decode rank, prefill rank) pair: its read lists and their prepared NIXL handles."""

    decode_rank: int
    prefill_rank: int
    remote_agent: str
    lists: ReadLists
    local: PreppedList
    remote: PreppedList


@dataclass(eq=False)
class PeerLink:
    target: str
    remote: pb.EngineLayout
    plan: TransferPlan
    pairs: list[PairLists] = field(default_factory=list)
    # (decode rank, remote agent name) loaded into that decode rank's agent
    added: list[tuple[int, str]] = field(default_factory=list)
    closed: bool = False
    closing: bool = False
    readers: int = 0  # requests reading through this link right now
    id_buffers: IdBufferPool = field(default_factory=IdBufferPool)  # descriptor-id arrays, reused
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def engine_id(self) -> str:
        return self.remote.engine_id

    @property
    def incarnation(self) -> int:
        return self.remote.incarnation

    def manifest_source(self, digests_required: bool) -> ManifestSource:
        """What a manifest from this peer must fit (its layout's groups and blocks)."""
        r = self.remote
        return ManifestSource(
            r.engine_id,
            len(r.groups),
            r.num_logical_blocks,
            digests_required=digests_required,
            vocab_size=r.model.vocab_size,
            num_layers=r.model.num_layers,
        )

    def readers_per_prefill_rank(self) -> list[int]:
        """How many decode ranks read from (and notify) each prefill rank per request."""
        counts = [0] * self.remote.tp_size
        for rank_plan in self.plan.ranks:
            for read in rank_plan.reads:
                counts[read.prefill_rank] += 1
        return counts

    @classmethod
    async def open(cls, host: EngineHost, target: str, remote: pb.EngineLayout) -> PeerLink:
        """Check the prefill engine's layout against ours, add its agents, prepare every list."""
        plan = check_pair(remote, host.message, local_role="decode", local_layout=host.layout, spec=host.spec)
        link = cls(target=target, remote=remote, plan=plan)
        try:
            for rank_plan in plan.ranks:
                d = rank_plan.decode_rank
                agent = host.agents[d]
                for read in rank_plan.reads:
                    p = read.prefill_rank
                    rank_msg = remote.ranks[p]
                    name = await _add_remote(host, d, remote, p)
                    link.added.append((d, name))
                    lists = build_read_lists(
                        plan,
                        d,
                        p,
                        local_bases=host.caches[d].base_addresses(),
                        remote_bases=list(rank_msg.region_base_addresses),
                        local_num_blocks=host.num_blocks,
                        remote_num_blocks=remote.num_logical_blocks,
                    )
                    place = MemoryPlace("VRAM" if rank_msg.device_type == pb.DEVICE_TYPE_CUDA else "DRAM", rank_msg.device_id)
                    local = await agent.prep_local(lists.local)
                    remote_list = await agent.prep_remote(name, lists.remote, place)
                    link.pairs.append(PairLists(d, p, name, lists, local, remote_list))
            await link.probe(host)
        except BaseException:
            await link.close(host)
            raise
        log.info(
            "linked prefill %s (%s, tp %d): %d rank pairs, readers per prefill rank %s",
            remote.engine_id, target, remote.tp_size, len(link.pairs), link.readers_per_prefill_rank(),
        )  # fmt: skip
        return link

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[PeerLink]:
        """Hold the link open while a request READs through it (refused once closing)."""
        if self.closing:
            raise Unavailable(
                f"the link to prefill {self.engine_id} ({self.target}) is closed (session lost)", reason="PEER_UNAVAILABLE"
            )
        self.readers += 1
        self._idle.clear()
        try:
            yield self
        finally:
            self.readers -= 1
            if not self.readers:
                self._idle.set()

    async def probe(self, host: EngineHost, timeout: float = 10.0) -> None:
        """One small READ per rank pair (one block per group, no notification): the data path to
        this prefill works, not just its gRPC port. Skipped when the local cache has no room."""
        key = f"probe:{self.target}:{self.incarnation:x}"
        try:
            local = await host.allocate_queued(key, 1, asyncio.get_running_loop().time() + 1.0, counted=False)
        except Exception as e:
            log.warning("no probe READ from prefill %s: %s", self.engine_id, e)
            return
        reads = ReadFence()
        try:
            remote_ids = [np.array([g % self.remote.num_logical_blocks]) for g in range(len(self.remote.groups))]
            for pair in self.pairs:
                lidx, ridx = read_indices(pair.lists, local.block_ids, remote_ids, 1)
                if lidx.size == 0:
                    continue
                agent = host.agents[pair.decode_rank]
                await host.poller.read(agent, pair.local, lidx, pair.remote, ridx, b"", timeout=timeout, fence=reads)
        except BaseException as e:
            reads.abandon()
            if isinstance(e, TransportError):
                raise Unavailable(
                    f"probe READ from prefill {self.engine_id} ({self.target}) failed: the gRPC port answers but "
                    f"the NIXL data path does not: {e}",
                    reason="PROBE_READ_FAILED",
                ) from e
            raise
        finally:
            reads.when_released(lambda: host.free(key))  # no READ may land in blocks given away

    async def close(self, host: EngineHost) -> None:
        """Wait for the requests reading through the link, then release the prepared lists and
        remove the remote agents (idempotent)."""
        if self.closing:
            return
        self.closing = True
        if self.readers:
            await self._idle.wait()  # they end quickly: their session is gone or closing
        self.closed = True
        for pair in self.pairs:
            agent = host.agents[pair.decode_rank]
            for prepped in (pair.local, pair.remote):
                try:
                    await agent.release_prepped(prepped)
                except Exception as e:  # the agent may already be closing
                    log.debug("releasing a prepared list failed: %s", e)
        for d, name in self.added:
            try:
                await host.agents[d].remove_remote(name)
            except Exception as e:
                log.debug("removing remote agent %s failed: %s", name, e)


async def _add_remote(host: EngineHost, decode_rank: int, remote: pb.EngineLayout, prefill_rank: int) -> str:
    """Load one prefill rank's agent metadata, naming the field when it is unusable."""
    field_name = f"layout.ranks[{prefill_rank}].agent_metadata"
    try:
        return await host.agents[decode_rank].add_remote(remote.ranks[prefill_rank].agent_metadata)
    except PeerAlreadyKnown as e:
        raise Unavailable(f"prefill {remote.engine_id}: {e}", field=field_name, reason="PEER_ALREADY_KNOWN") from e
    except PeerMetadataRejected as e:
        raise InvalidArgument(f"prefill {remote.engine_id} sent agent metadata NIXL cannot load: {e}", field=field_name) from e
    except TransportError as e:
        raise Unavailable(f"cannot connect to prefill {remote.engine_id}'s agent: {e}", field=field_name) from e
