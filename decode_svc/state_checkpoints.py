"""Decode's state checkpoints: the conv / SSM state of finished requests' computed prompts, so a
request whose computed prefix is exactly one already READ needs no prefill job and no READ.

Prefill computes every prompt from token 0 and is deterministic: the same computed tokens on an
engine of the same chain (`prefix_cache.Chain`: model, prefill TP, engine kind, chunk size) give
the same bytes. So the state a request READ is what prefill would send again for a request with
the same computed tokens (a retry, a regenerate, several samples of one prompt). A checkpoint
holds a copy of what the prefix cache does not: the Mamba groups' blocks, and the attention
blocks after the cache's `lead` full blocks (the block the computed tokens end inside, and for a
chunked hf prefill those of its last chunk, which the cache never shares). It is usable only
with the cache's chain covering exactly those `lead` blocks, which is why it needs
--prefix-cache-blocks.

A checkpoint is taken right after a request's READ and its digest check (before its first
decode step updates the SSM state in place); with digests on it carries the digests of those
bytes, and a request restoring it recomputes them from its own blocks: a mismatch discards the
checkpoint and the request takes the ordinary prefill job and READ.

At the full-N boundary prefill also sampled the first output token, and decode has no logits to
sample it again: the checkpoint keeps the token the manifest brought, and its key also names
what that draw depended on besides the logits (`sampling.first_draw`: greedy, or temperature,
top_p, top_k and seed; and the ids masked at index 0). So a greedy retry, or a sample with the
same seed, restores it and streams that token at once; another seed (or none given, so decode
picked a random one) misses and takes the ordinary path. At n-1 the key is the tokens alone:
decode samples every output token itself.

The copies live in blocks of the engine's own pool, held in the allocator under one holder id
per checkpoint (`Checkpoint.holder`) and copied block to block on the compute thread, so they
count among the blocks in use and are bounded by the cache's memory. A checkpoint is taken only
from free blocks, or from blocks of older unused checkpoints, and never while a request waits
for blocks (that request gets what is freed first): a take that finds no room is skipped, the
next request with that prompt simply prefills. An allocation that finds too few free blocks
reclaims unused checkpoints, least recently used first, before the prefix cache's blocks
(`reuse.DecodeReuse.reclaim` says why). --prefix-cache-states bounds their count as well. One
that a request is restoring is pinned and never evicted, and an entry is never overwritten (a
key already held is not taken again); one found corrupt leaves the index at once and its blocks
are freed when its last user ends.
Single-threaded: used from the event loop; `take` and `restore` run on the compute thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from decode_svc.block_copies import copy_blocks, state_block_ids
from decode_svc.peer_link import PeerLink
from decode_svc.prefix_cache import Chain, Hit, cacheable_blocks, skipped_bytes
from shared.cache.digest import SectionDigest, compare_digests, state_digests
from shared.engine.protocol import RequestBlocks
from shared.engine.sampling import SamplingParams, first_draw
from shared.observe import Count, Observer
from shared.runtime.engine_host import EngineHost

log = logging.getLogger(__name__)
T = TypeVar("T")


class Compute(Protocol):
    """Runs a call on the compute thread (`ComputeGuard.run`)."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


def state_key(chain: Chain, prompt: Sequence[int], computed: int, draw: SamplingParams | None = None) -> bytes:
    """Names the computation: the chain's root and exactly the computed tokens; at the full-N
    boundary also `draw`, the first token's sampling identity (`sampling.first_draw`)."""
    h = hashlib.blake2b(chain.root, digest_size=16)
    h.update(computed.to_bytes(8, "little"))
    h.update(np.asarray(prompt[:computed], dtype=np.int64).tobytes())
    if draw is not None:
        fields = (draw.temperature, draw.top_p, draw.top_k, draw.seed, draw.min_tokens, sorted(draw.stop_token_ids))
        h.update(b"first-draw" + repr(fields).encode())  # repr: floats round-trip exactly
    return h.digest()


@dataclass
class Checkpoint:
    key: bytes
    computed: int  # prompt tokens whose state it holds
    lead: int  # leading full attention blocks the prefix cache supplies
    holder: str  # the allocator's holder id of its blocks
    blocks: np.ndarray  # its own pool blocks: the copies of a request's blocks (`_own_ids` order)
    digests: tuple[SectionDigest, ...]  # of those bytes as they entered (empty: digests off)
    saved_bytes: int  # what a READ of them would move (attention after `lead` blocks, conv, SSM)
    first_token: int | None = None  # full-N: the token prefill sampled (None: n-1)
    users: int = 0  # requests restoring it now: never evicted while > 0
    dropped: bool = False  # found corrupt: out of the index, freed when the last user ends

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.size)


class StateCheckpoints:
    def __init__(self, host: EngineHost, capacity: int, observer: Observer | None = None) -> None:
        self.host = host
        self.capacity = capacity
        self.observer = observer or Observer()
        self.enabled = capacity > 0
        self.full = host.engine.boundary == "full"  # keys name the first token's draw too
        self._entries: OrderedDict[bytes, Checkpoint] = OrderedDict()  # least recently used first
        self._taking: set[bytes] = set()  # keys whose copy is being taken now
        # One holder id per checkpoint ever taken: a corrupt one may still hold its blocks while
        # a new one of the same key is taken.
        self._holders = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_blocks(self) -> int:
        """Pool blocks the checkpoints in the index hold."""
        return sum(c.num_blocks for c in self._entries.values())

    def _own_ids(self, blocks: RequestBlocks, lead: int, computed: int) -> np.ndarray:
        """The request's blocks a checkpoint holds (`state_block_ids`)."""
        return state_block_ids(self.host.layout, blocks, lead, computed)

    def _digests(self, blocks: RequestBlocks, lead: int, computed: int) -> tuple[SectionDigest, ...]:
        if not self.host.verify_transfer:
            return ()
        layout = self.host.layout
        return tuple(state_digests(layout, self.host.views, blocks.block_ids, computed, tokens_from=lead * layout.block_size))

    def _copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        copy_blocks(self.host.views, src, dst)

    def _key(self, chain: Chain, prompt: Sequence[int], computed: int, sampling: SamplingParams) -> bytes:
        return state_key(chain, prompt, computed, first_draw(sampling) if self.full else None)

    def lookup(
        self, chain: Chain | None, prompt: Sequence[int], computed: int, hit: Hit, sampling: SamplingParams
    ) -> Checkpoint | None:
        """The checkpoint of exactly these computed tokens (at full-N: and a first token drawn as
        `sampling` draws it) whose attention lead `hit` covers, pinned."""
        found = self._usable(chain, prompt, computed, len(hit.entries), sampling)
        if found is not None:
            found.users += 1
            self._entries.move_to_end(found.key)
        self.observer.count(Count.PREFIX_STATE_HIT if found is not None else Count.PREFIX_STATE_MISS)
        return found

    def holds(self, chain: Chain | None, prompt: Sequence[int], computed: int, lead: int, sampling: SamplingParams) -> bool:
        """Whether `lookup` would find one with a hit of `lead` blocks: nothing pinned or counted."""
        return self._usable(chain, prompt, computed, lead, sampling) is not None

    def _usable(
        self, chain: Chain | None, prompt: Sequence[int], computed: int, lead: int, sampling: SamplingParams
    ) -> Checkpoint | None:
        if not self.enabled or chain is None:
            return None
        found = self._entries.get(self._key(chain, prompt, computed, sampling))
        return found if found is not None and found.lead == lead else None

    def release(self, checkpoint: Checkpoint) -> None:
        checkpoint.users -= 1
        if checkpoint.dropped and checkpoint.users == 0:
            self.host.free(checkpoint.holder)

    def restore(self, checkpoint: Checkpoint, blocks: RequestBlocks) -> bool:
        """On the compute thread: copy the checkpoint into the request's own blocks; whether
        they then have its digests (always True with digests off)."""
        self._copy(checkpoint.blocks, self._own_ids(blocks, checkpoint.lead, checkpoint.computed))
        got = self._digests(blocks, checkpoint.lead, checkpoint.computed)
        return not compare_digests(self.host.layout, checkpoint.digests, got)

    async def restored(self, run: Compute, checkpoint: Checkpoint, blocks: RequestBlocks) -> bool:
        """`restore` on the compute thread (`run`); False (and the checkpoint discarded) when the
        copy lacks its digests: the request then takes the ordinary prefill job and READ."""
        if await run(lambda: self.restore(checkpoint, blocks)):
            return True
        self.discard(checkpoint)
        log.warning("request %s: a state checkpoint differs from its digests; discarded, prefilling", blocks.request_id)
        return False

    def discard(self, checkpoint: Checkpoint) -> None:
        """Drop a checkpoint found corrupt: no lookup finds it again, and its blocks are freed
        once no request restores it (the requests restoring it have their copies)."""
        if self._entries.get(checkpoint.key) is checkpoint:
            del self._entries[checkpoint.key]
            self._count_eviction()
            checkpoint.dropped = True
            if checkpoint.users == 0:
                self.host.free(checkpoint.holder)

    def reclaim(self, n: int) -> int:
        """Free up to `n` blocks of unused checkpoints, least recently used first; how many freed."""
        freed = 0
        for checkpoint in [c for c in self._entries.values() if c.users == 0]:
            if freed >= n:
                break
            freed += self._evict(checkpoint)
        return freed

    def _evict(self, checkpoint: Checkpoint) -> int:
        del self._entries[checkpoint.key]
        self._count_eviction()
        return self.host.free(checkpoint.holder)

    def _room_for(self, n: int) -> bool:
        """Make room for one more checkpoint of `n` blocks: under the count bound and with `n`
        free blocks, evicting unused checkpoints (least recently used first) only if that is
        enough; never while a request waits for blocks, and never the prefix cache's blocks."""
        if self.host.waiting_for_blocks:
            return False
        unused = [c for c in self._entries.values() if c.users == 0]
        over = len(self._entries) + 1 - self.capacity  # checkpoints to evict for the count bound
        free = self.host.allocator.num_free
        if over > len(unused) or free + sum(c.num_blocks for c in unused) < n:
            return False
        for victim in unused:
            if over <= 0 and free >= n:
                break
            free += self._evict(victim)
            over -= 1
        return True

    def wanted(self, chain: Chain | None, prompt: Sequence[int], computed: int, sampling: SamplingParams) -> bytes | None:
        """The key to take a checkpoint under, if it is not held yet."""
        if not self.enabled or chain is None:
            return None
        key = self._key(chain, prompt, computed, sampling)
        return None if key in self._entries or key in self._taking else key

    def take(
        self, src: np.ndarray, dst: np.ndarray, blocks: RequestBlocks, lead: int, computed: int
    ) -> tuple[SectionDigest, ...]:
        """On the compute thread: copy the request's blocks `src` (its state, just READ and
        checked) into the checkpoint's `dst`; the digests of those bytes."""
        self._copy(src, dst)
        return self._digests(blocks, lead, computed)

    async def keep(
        self,
        run: Compute,
        chain: Chain | None,
        link: PeerLink,
        prompt: Sequence[int],
        blocks: RequestBlocks,
        computed: int,
        state_bytes: int,
        sampling: SamplingParams,
        first_token: int | None,
    ) -> bool:
        """A checkpoint of the request's state, just READ from `link` and checked (its conv and
        SSM `state_bytes`; at full-N with the `first_token` prefill drew with `sampling`), unless
        one is held already or no blocks are free for it (`_room_for`); whether one was kept.
        Its blocks are allocated here and filled by `take` on the compute thread (`run`)."""
        if self.full != (first_token is not None):
            return False  # the boundary's first token is missing (or unexpected): nothing to key it by
        key = self.wanted(chain, prompt, computed, sampling)
        if key is None or chain is None:
            return False
        size = self.host.layout.block_size
        lead = cacheable_blocks(computed, size, chain.unit)
        src = self._own_ids(blocks, lead, computed)
        if not self._room_for(int(src.size)):
            log.debug("request %s: no free blocks for a state checkpoint; not taken", blocks.request_id)
            return False
        holder = f"state-checkpoint:{key.hex()}:{next(self._holders)}"
        dst = self.host.allocator.allocate(holder, int(src.size))
        # What a later READ would move that the prefix cache's lead does not already save.
        saved = skipped_bytes(link, computed) - skipped_bytes(link, lead * size) + state_bytes
        self._taking.add(key)
        copying = asyncio.ensure_future(run(lambda: self.take(src, dst, blocks, lead, computed)))
        try:
            digests = await asyncio.shield(copying)
        except BaseException:
            # The copy may still be writing them: the blocks go back once it ended.
            copying.add_done_callback(lambda done: _free_after(self.host, holder, done))
            raise
        finally:
            self._taking.discard(key)
        return self.insert(Checkpoint(key, computed, lead, holder, dst, digests, saved, first_token))

    def insert(self, checkpoint: Checkpoint) -> bool:
        """Keep `checkpoint` (its blocks already held under its holder id), evicting the least
        recently used unpinned ones past the bound; False (its blocks freed) when its key is held
        already or every held one is in use."""
        if checkpoint.key in self._entries or not self._under_bound():
            self.host.free(checkpoint.holder)
            return False
        self._entries[checkpoint.key] = checkpoint
        return True

    def _under_bound(self) -> bool:
        """Evict unused checkpoints until one more fits the count bound; whether it does."""
        while len(self._entries) >= self.capacity:
            victim = next((c for c in self._entries.values() if c.users == 0), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _count_eviction(self) -> None:
        self.observer.count(Count.PREFIX_STATE_EVICTED)


def _free_after(host: EngineHost, holder: str, done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()  # retrieved: the request that took it already failed with its own error
    host.free(holder)
