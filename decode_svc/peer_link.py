"""What decode keeps per handshaken prefill engine: remote agents added, the transfer plan, and
the local and remote descriptor lists prepared once per (decode rank, prefill rank) pair.

Built once per prefill incarnation. Closing it releases the prepared lists and removes the
remote agents, which must happen before a restarted prefill (same agent names, new memory)
can be added again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shared.layout.plan import TransferPlan
from shared.layout.read_lists import ReadLists, build_read_lists
from shared.pb.hybridpd.v1 import layout_pb2 as pb
from shared.rpc.compat import check_pair
from shared.rpc.engine_host import EngineHost
from shared.transport.agent import PreppedList
from shared.transport.memory import MemoryPlace

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

    @property
    def engine_id(self) -> str:
        return self.remote.engine_id

    @property
    def incarnation(self) -> int:
        return self.remote.incarnation

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
                    name = await agent.add_remote(rank_msg.agent_metadata)
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
                    place = MemoryPlace(
                        "VRAM" if rank_msg.device_type == pb.DEVICE_TYPE_CUDA else "DRAM", rank_msg.device_id
                    )
                    local = await agent.prep_local(lists.local)
                    remote_list = await agent.prep_remote(name, lists.remote, place)
                    link.pairs.append(PairLists(d, p, name, lists, local, remote_list))
        except BaseException:
            await link.close(host)
            raise
        log.info(
            "linked prefill %s (%s, tp %d): %d rank pairs, readers per prefill rank %s",
            remote.engine_id, target, remote.tp_size, len(link.pairs), link.readers_per_prefill_rank(),
        )  # fmt: skip
        return link

    async def close(self, host: EngineHost) -> None:
        """Release the prepared lists and remove the remote agents (idempotent)."""
        if self.closed:
            return
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
