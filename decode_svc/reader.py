"""Manifest + cached plan -> ONE NIXL READ per (decode rank, prefill rank), awaited together
(per manifest part, with pipelined transfer: decode_svc/part_reads.py).

Per request only index arrays are built (vectorised, from the prepared lists); each READ
carries the FA and Mamba descriptors of every layer for its rank pair and the manifest's
transfer id as notification, so the prefill rank frees the blocks once all its readers are
done. A pair with nothing to read still notifies (send_notif), so the counts add up.

Failure and cancellation: the other READs are cancelled and every READ is handed to the
request's `ReadFence`, which releases their handles; decode frees its blocks and tells prefill
to unpin only once the fence says every handle is released, so no READ can land in blocks that
belong to another request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from decode_svc.peer_link import PairLists, PeerLink
from shared import observe
from shared.cache.id_buffers import IdBuffers
from shared.cache.manifest import Manifest
from shared.engine.protocol import RequestBlocks
from shared.errors import DeadlineExceeded, Internal, Unavailable
from shared.layout.read_lists import IdArray, read_indices
from shared.layout.spec import LayoutError
from shared.observe import Stage, Step
from shared.otel import spans
from shared.runtime.engine_host import EngineHost
from shared.transport.agent import RankAgent
from shared.transport.errors import TransferTimedOut, TransportError
from shared.transport.poller import ReadResult
from shared.transport.read_fence import ReadFence

log = logging.getLogger(__name__)


@dataclass
class ReadStats:
    attention_bytes: int = 0
    conv_bytes: int = 0
    ssm_bytes: int = 0
    read_count: int = 0
    descriptor_count: int = 0
    seconds: float = 0.0
    post_seconds: list[float] = field(default_factory=list)  # one per READ posted

    @property
    def total_bytes(self) -> int:
        return self.attention_bytes + self.conv_bytes + self.ssm_bytes

    def add(self, other: ReadStats) -> None:
        self.attention_bytes += other.attention_bytes
        self.conv_bytes += other.conv_bytes
        self.ssm_bytes += other.ssm_bytes
        self.read_count += other.read_count
        self.descriptor_count += other.descriptor_count
        self.post_seconds += other.post_seconds


def _pair_bytes(link: PeerLink, pair: PairLists, local_idx: IdArray, manifest: Manifest) -> ReadStats:
    """Bytes of one READ by kind of state: counted from the token count (every region of a
    group moves the same pieces), not summed over the ids."""
    read = link.plan.ranks[pair.decode_rank].read_from(pair.prefill_rank)
    fa, conv, ssm = pair.lists.bytes_for(
        manifest.tokens_to,
        read.ssm is not None,
        tokens_from=manifest.tokens_from,
        mamba=manifest.ends_prompt,
        layers=manifest.layers,
    )
    stats = ReadStats(attention_bytes=fa, conv_bytes=conv, ssm_bytes=ssm, read_count=1, descriptor_count=int(local_idx.size))
    return stats


def read_attributes(link: PeerLink, stats: ReadStats) -> dict[str, AttributeValue]:
    """What one manifest's READ did (the READ span's attributes)."""
    return {"hybrid_pd.prefill_engine_id": link.engine_id, **_moved(stats)}


def transfer_attributes(stats: ReadStats) -> dict[str, AttributeValue]:
    """What a request's READs did (`Stage.TRANSFER`)."""
    return {**_moved(stats), observe.TRANSFER_POST_SECONDS: stats.post_seconds}


def _moved(stats: ReadStats) -> dict[str, AttributeValue]:
    return {
        observe.TRANSFER_READS: stats.read_count,
        observe.TRANSFER_DESCRIPTORS: stats.descriptor_count,
        observe.TRANSFER_BYTES: stats.total_bytes,
        observe.TRANSFER_ATTENTION_BYTES: stats.attention_bytes,
        observe.TRANSFER_CONV_BYTES: stats.conv_bytes,
        observe.TRANSFER_SSM_BYTES: stats.ssm_bytes,
    }


async def _read_one(
    host: EngineHost,
    agent: RankAgent,
    pair: PairLists,
    lidx: IdArray,
    ridx: IdArray,
    notif: bytes,
    timeout: float,
    stats: ReadStats,
    ids: IdBuffers,
    fence: ReadFence,
) -> ReadResult:
    """One READ, handed to `fence` as soon as it is posted (the fence releases it if abandoned).
    NIXL copies the ids when it prepares the READ: their arrays serve the next request once the
    post is done."""
    result = await host.poller.read(
        agent, pair.local, lidx, pair.remote, ridx, notif, timeout=timeout, fence=fence, on_posted=ids.release
    )
    stats.post_seconds.append(result.post_seconds)
    if observe.listening():
        ranks = {"hybrid_pd.decode_rank": pair.decode_rank, "hybrid_pd.prefill_rank": pair.prefill_rank}
        observe.stage(Stage.READ_PAIR, result.post_seconds, ranks)
    return result


@spans.traced(spans.READ, SpanKind.CLIENT)
async def read_request(
    host: EngineHost,
    link: PeerLink,
    manifest: Manifest,
    local: RequestBlocks,
    *,
    timeout: float,
    fence: ReadFence,
) -> ReadStats:
    """Move the request's state for its `num_computed_tokens` tokens into `local`'s blocks (a
    manifest part: the K/V of its tokens, and with a part that ends the prompt the conv and SSM
    state; a layer part: of its layers only).
    Every READ is added to `fence`; on failure the fence is abandoned (see the module doc)."""
    remote_blocks = manifest.block_ids  # checked against the peer's layout when it arrived
    notif = manifest.transfer_id.encode()
    num_tokens, tokens_from, mamba, layers = manifest.tokens_to, manifest.tokens_from, manifest.ends_prompt, manifest.layers
    if timeout <= 0:
        raise DeadlineExceeded("no time left to read the prefilled state (deadline or lease ran out)")
    stats = ReadStats()
    jobs: list[asyncio.Future[object]] = []
    try:
        try:
            for pair in link.pairs:
                ids = link.id_buffers.claim()
                try:
                    lidx, ridx = read_indices(
                        pair.lists,
                        local.block_ids,
                        remote_blocks,
                        num_tokens,
                        buffers=ids,
                        tokens_from=tokens_from,
                        mamba=mamba,
                        layers=layers,
                    )
                    observe.mark(Step.IDS)
                except LayoutError as e:
                    ids.release()
                    raise Internal(
                        f"manifest from prefill {link.engine_id} does not fit the plan: {e}", field="manifest.groups"
                    ) from e
                agent = host.agents[pair.decode_rank]
                if lidx.size == 0:
                    ids.release()
                    jobs.append(asyncio.ensure_future(agent.send_notif(pair.remote_agent, notif)))
                    continue
                stats.add(_pair_bytes(link, pair, lidx, manifest))
                observe.mark(Step.BYTES)
                read = _read_one(host, agent, pair, lidx, ridx, notif, timeout, stats, ids, fence)
                jobs.append(asyncio.ensure_future(read))
            started = time.monotonic()
            await asyncio.gather(*jobs)
            stats.seconds = time.monotonic() - started
            if observe.listening():
                observe.stage(Stage.READ, stats.seconds, read_attributes(link, stats))
            return stats
        except BaseException:
            # Stop the other READs; the fence releases every handle and then runs what waits
            # for that (freeing the blocks here, unpinning them on prefill).
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            fence.abandon()
            raise
    except TransferTimedOut as e:
        raise Unavailable(f"READ from prefill {link.engine_id} ({link.target}) timed out: {e}", reason="READ_TIMEOUT") from e
    except TransportError as e:
        raise Unavailable(f"READ from prefill {link.engine_id} ({link.target}) failed: {e}", reason="READ_FAILED") from e
