"""Prefill's boundary cache: prefix reuse on prefill, so a conversation's next turn computes only
its new tokens.

With chunked prefill (--prefill-chunk-tokens C) chunks are cut at multiples of C, and a chunk
computed from the same tokens after the same chunks gives the same bits. So the K/V of tokens
[0, b) and the conv / SSM state after the chunk ending at b (a multiple of C) are all a later
prompt with the same first b tokens needs to compute on from b, bit for bit as from token 0
(`ResumablePrefill`). A boundary is keyed by a hash chain over the prompt's chunks of C tokens,
rooted in the engine's identity (model, TP, engine kind, chunk size, block size).

A boundary holds:
- the attention blocks wholly inside [0, b), shared: a job resuming there takes them as its
  leading blocks (never written again: it writes from b on), and decode READs them from there
  as from any job's blocks. A boundary kept by a job that itself resumed at an earlier boundary
  (its parent) holds only the blocks after the parent's, and the parent stays while it has
  children;
- a copy (its own blocks) of every Mamba group's conv / SSM state at b and, when b is not a
  multiple of the block size, of the attention blocks' partly filled block at b. A job resuming
  there copies them into its own blocks before its first chunk.

Each job keeps at most one boundary, its last one (the largest multiple of C below the tokens it
computes): what the conversation's next turn resumes from. The copies' blocks are taken from free
blocks only, never while a job waits for blocks, within --prefix-cache-blocks; a job short of
blocks takes back unused boundaries, least recently used first (`reclaim`). A boundary a job uses
is pinned until that job's blocks are freed (its pin ended: decode READ them). A job that asks for
prompt logprobs computes from token 0 (they need every chunk's logits) but may still keep its
boundary. Single-threaded: used from the event loop; `restore` and `take` run on the compute
thread.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.cache.block_copy import copy_blocks
from shared.engine.protocol import ChunkedPrefill, PrefillRun, RequestBlocks, ResumablePrefill
from shared.observe import Count, Observer
from shared.runtime.engine_host import EngineHost

log = logging.getLogger(__name__)


def root_key(model: str, tp: int, engine_kind: str, chunk_tokens: int, block_size: int) -> bytes:
    """The engine's identity: boundaries of another engine never match."""
    return hashlib.blake2b(
        f"{model}|tp={tp}|{engine_kind}|chunk={chunk_tokens}|block={block_size}".encode(), digest_size=16
    ).digest()


def boundary_keys(root: bytes, prompt: Sequence[int], chunk_tokens: int, below: int) -> list[tuple[int, bytes]]:
    """(b, key) of every multiple b of `chunk_tokens` in (0, below): a hash chain over the chunks."""
    h = hashlib.blake2b(root, digest_size=16)
    out: list[tuple[int, bytes]] = []
    ids = np.asarray(prompt[: max(0, below)], dtype=np.int64)
    for b in range(chunk_tokens, below, chunk_tokens):
        h.update(ids[b - chunk_tokens : b].tobytes())
        out.append((b, h.copy().digest()))
    return out


@dataclass(eq=False)
class Boundary:
    key: bytes
    tokens: int  # b: the prompt tokens whose state it holds
    holder: str  # the allocator's holder id of its own blocks
    lead: list[np.ndarray]  # per layout group: the attention blocks of tokens [0, b // block * block) (Mamba: none)
    copies: list[np.ndarray]  # per layout group: its copies (Mamba: the state block; attention: the partial block, or none)
    own: int  # blocks it holds: its share of `lead` and its copies
    parent: Boundary | None = None
    users: int = 0  # jobs using its blocks now: never evicted while > 0
    children: int = 0  # boundaries whose lead starts with its blocks: never evicted while > 0


@dataclass(eq=False)
class Pending:
    """A boundary a job will keep: its copies' blocks, allocated before the job computes and
    filled by `take` on the compute thread right after the job's chunk ending at `tokens`."""

    key: bytes
    tokens: int
    holder: str
    copies: list[np.ndarray]
    parent: Boundary | None
    taken: bool = False  # set on the compute thread once the copies hold the state
    done: bool = False  # inserted, or abandoned (its blocks freed)


@dataclass
class Hit:
    """The boundary a job resumes from, pinned until the job's blocks are freed."""

    boundary: Boundary
    released: bool = field(default=False)

    @property
    def tokens(self) -> int:
        return self.boundary.tokens


class BoundaryCache:
    def __init__(self, host: EngineHost, capacity_blocks: int, chunk_tokens: int, observer: Observer | None = None) -> None:
        self.host = host
        self.capacity_blocks = capacity_blocks
        self.chunk_tokens = chunk_tokens
        self.observer = observer or Observer()
        engine = host.engine
        self.enabled = capacity_blocks > 0 and chunk_tokens > 0 and usable(engine, chunk_tokens)
        layout = host.layout
        self.block_size = layout.block_size
        self._attention = list(layout.attention_group_ids)
        self._kinds = [g.kind for g in layout.groups]
        self.root = root_key(layout.spec.name, layout.tp, type(engine).__name__, chunk_tokens, layout.block_size)
        self._entries: OrderedDict[bytes, Boundary] = OrderedDict()  # least recently used first
        self._pending: set[bytes] = set()
        self._holders = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_blocks(self) -> int:
        """Blocks the boundaries hold (counted in the cache's blocks in use)."""
        return sum(b.own for b in self._entries.values())

    # ---- resuming ----

    def lookup(self, prompt: Sequence[int], computed: int) -> Hit | None:
        """The longest kept boundary of `prompt` below `computed` (at least one chunk is left to
        compute), pinned; None when there is none."""
        if not self.enabled:
            return None
        found = None
        for _, key in reversed(boundary_keys(self.root, prompt, self.chunk_tokens, computed)):
            found = self._entries.get(key)
            if found is not None:
                break
        self.observer.count(Count.BOUNDARY_HIT if found is not None else Count.BOUNDARY_MISS)
        if found is None:
            return None
        found.users += 1
        chain: Boundary | None = found
        while chain is not None:  # the head most recent: leaves are evicted first
            self._entries.move_to_end(chain.key)
            chain = chain.parent
        self.observer.count(Count.BOUNDARY_SKIPPED_TOKENS, found.tokens)
        return Hit(found)

    def release(self, hit: Hit) -> None:
        if not hit.released:
            hit.released = True
            hit.boundary.users -= 1

    def leading(self, hit: Hit | None) -> list[np.ndarray] | None:
        """Per layout group: the blocks a job resuming at `hit` puts first (None: no hit)."""
        return None if hit is None else [ids.copy() for ids in hit.boundary.lead]

    def restore(self, hit: Hit, blocks: RequestBlocks) -> None:
        """On the compute thread: the boundary's copies into the job's own blocks (every Mamba
        group's block; the attention groups' block the boundary ends inside)."""
        src, dst = self._copy_pairs(hit.boundary.copies, blocks, hit.tokens)
        copy_blocks(self.host.views, src, dst)

    def _copy_pairs(self, copies: list[np.ndarray], blocks: RequestBlocks, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(the boundary's copy blocks, the job's blocks they correspond to)."""
        src, dst = [], []
        partial = tokens // self.block_size
        for g, (kept, own) in enumerate(zip(copies, blocks.block_ids)):
            if not kept.size:
                continue
            src.append(kept)
            dst.append(own[partial : partial + 1] if self._kinds[g] == "attention" else own)
        if not src:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        return np.concatenate(src).astype(np.int64), np.concatenate(dst).astype(np.int64)

    # ---- keeping ----

    def plan(self, prompt: Sequence[int], computed: int, hit: Hit | None) -> Pending | None:
        """The boundary a job computing `computed` tokens of `prompt` from `hit` will keep (its
        last below `computed`), with its copies' blocks allocated now; None when there is none
        after the hit, it is kept (or being kept) already, or no room is free for it."""
        if not self.enabled:
            return None
        keys = boundary_keys(self.root, prompt, self.chunk_tokens, computed)
        if not keys:
            return None
        tokens, key = keys[-1]
        start = 0 if hit is None else hit.tokens
        if tokens <= start or key in self._entries or key in self._pending:
            return None
        n_attn = len(self._attention)
        partial = tokens % self.block_size != 0
        fresh = len(self._kinds) - n_attn + (n_attn if partial else 0)
        shared = (tokens // self.block_size - start // self.block_size) * n_attn
        if not self._room_for(fresh + shared, fresh):
            return None
        holder = f"prefill-boundary:{key.hex()}:{next(self._holders)}"
        ids = self.host.allocator.allocate(holder, fresh)
        copies, used = [], 0
        for kind in self._kinds:
            n = 1 if kind == "mamba" or partial else 0
            copies.append(ids[used : used + n])
            used += n
        self._pending.add(key)
        return Pending(key, tokens, holder, copies, None if hit is None else hit.boundary)

    def take(self, pending: Pending, engine: ResumablePrefill, run: PrefillRun, blocks: RequestBlocks) -> None:
        """On the compute thread, right after the job's chunk ending at `pending.tokens`: the
        run's conv / SSM state and the partly filled attention block into the copies."""
        copies = RequestBlocks(pending.holder, pending.copies)
        engine.keep_boundary_state(run, copies)
        attention = [g for g, k in enumerate(self._kinds) if k == "attention" and pending.copies[g].size]
        if attention:  # the job's partial blocks into the copies (the Mamba ones were written above)
            partial = pending.tokens // self.block_size
            own = np.concatenate([blocks.block_ids[g][partial : partial + 1] for g in attention]).astype(np.int64)
            kept = np.concatenate([pending.copies[g] for g in attention]).astype(np.int64)
            copy_blocks(self.host.views, own, kept)
        pending.taken = True

    def insert(self, pending: Pending, blocks: RequestBlocks) -> Boundary | None:
        """Keep the boundary the job `blocks` computed (its copies taken): its attention blocks
        after the parent's go from the job to the boundary, which the job uses (pinned) until its
        blocks are freed. None (the copies' blocks freed) when not taken or kept meanwhile."""
        if pending.done:
            return None
        pending.done = True
        self._pending.discard(pending.key)
        if not pending.taken or pending.key in self._entries:
            self.host.free(pending.holder)
            return None
        start = 0 if pending.parent is None else pending.parent.tokens // self.block_size
        end = pending.tokens // self.block_size
        lead = [np.empty(0, dtype=np.int64) for _ in self._kinds]
        moved = []
        for g in self._attention:
            lead[g] = np.asarray(blocks.block_ids[g][:end], dtype=np.int64).copy()
            moved.append(lead[g][start:end])
        if moved:
            self.host.allocator.transfer(blocks.request_id, pending.holder, np.concatenate(moved))
        own = self.host.allocator.held(pending.holder)
        boundary = Boundary(pending.key, pending.tokens, pending.holder, lead, pending.copies, own, pending.parent)
        if pending.parent is not None:
            pending.parent.children += 1
        boundary.users += 1  # the job's blocks list them until it is freed
        self._entries[boundary.key] = boundary
        self.host.when_freed(blocks.request_id, lambda: self.release(Hit(boundary)))
        return boundary

    def abandon(self, pending: Pending) -> None:
        """The job ended without keeping it: its copies' blocks go back."""
        if not pending.done:
            pending.done = True
            self._pending.discard(pending.key)
            self.host.free(pending.holder)

    # ---- room ----

    def _evictable(self) -> list[Boundary]:
        return [b for b in self._entries.values() if b.users == 0 and b.children == 0]

    def reclaim(self, n: int) -> int:
        """Free up to `n` blocks of unused boundaries, least recently used leaves first (a
        parent becomes a leaf once its children are gone); how many freed."""
        freed = 0
        while freed < n:
            victims = self._evictable()
            if not victims:
                break
            freed += self._evict(victims[0])
        return freed

    def _evict(self, boundary: Boundary) -> int:
        del self._entries[boundary.key]
        if boundary.parent is not None:
            boundary.parent.children -= 1
        self.observer.count(Count.BOUNDARY_EVICTED)
        return self.host.free(boundary.holder)

    def _room_for(self, blocks: int, fresh: int) -> bool:
        """Make room for a boundary of `blocks` blocks, `fresh` of them from free blocks: never
        while a job waits for blocks; evicting unused boundaries only if that is enough."""
        if self.host.waiting_for_blocks or blocks > self.capacity_blocks:
            return False
        over = self.num_blocks + blocks - self.capacity_blocks
        short = fresh - self.host.allocator.num_free
        if over > 0 or short > 0:
            if sum(b.own for b in self._evictable()) < max(over, short):
                return False  # a rough bound: parents freed on the way are not counted
            self.reclaim(max(over, short, 0))
        return self.num_blocks + blocks <= self.capacity_blocks and self.host.allocator.num_free >= fresh


def usable(engine: object, chunk_tokens: int) -> bool:
    """Whether `engine` resumes a chunked prefill of `chunk_tokens` exactly."""
    return (
        isinstance(engine, ResumablePrefill)
        and isinstance(engine, ChunkedPrefill)
        and engine.resumes_exactly
        and engine.exact_chunk_tokens in (None, chunk_tokens)
    )
