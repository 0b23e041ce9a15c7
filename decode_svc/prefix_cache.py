"""Decode's prefix cache: the attention blocks of finished requests' prompts, kept for the next
request whose prompt starts with the same tokens (the next turn of a conversation).

An entry is one full decode block of a prompt: its block id in every attention group, keyed by
a chained content hash (the previous block's key and this block's tokens, as vLLM keys its
blocks), so a key names the whole prefix up to the block's end. The chain starts from a root
naming what computed the K/V (model, prefill TP, engine kind and prefill chunk size,
`root_key`): blocks are reused only for jobs to prefill engines that would write the same bytes.

Only blocks READ from prefill wholly inside a prompt's computed tokens enter (decode's own steps
never write them), and only at the granularity U the engine says its K/V of a prefix does not
depend on what follows (`Engine.prefix_stable_unit`, for the prefill peer's chunk size; None:
nothing is cached): the K/V of a block depends on the tokens up to the end of the last unit it
touches (its reach, `reach`), so its key hashes exactly those tokens, and a block enters or is
found only when its reach lies within the prompt's computed tokens. Identical keys then mean
the block's K/V were computed by identical units on identical inputs: exact by construction
(the hf engine with --prefill-chunk-tokens C: U = C, and a block of a chunk that ended the
prompt early, or whose chunk continued with other tokens, is never shared). With digests on, an entry carries the FA
digests of its bytes taken when it entered (after the request's digest check passed); a request
reusing it recomputes them (`verify`), since prefill's digests cover only what was READ.

Entries are pinned while a request uses them (`Hit.release` unpins) and never evicted then;
otherwise evicted least recently used when an allocation finds too few free blocks (`reclaim`,
called after the state checkpoints gave up theirs: `reuse.DecodeReuse.reclaim`), or when the
cache is over its bound. A lookup touches the hit from the last block to the first,
so a chain's tail goes before its head. The cache holds its blocks in the allocator under one
holder id per entry, so freeing an entry is the allocator's ordinary free.

Single-threaded: used from the event loop only (digests run on the compute thread).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from decode_svc.peer_link import PeerLink
from shared.cache.digest import SectionDigest, block_digests, compare_digests
from shared.engine.protocol import RequestBlocks
from shared.observe import Count, Observer
from shared.runtime.engine_host import EngineHost

IntArray = np.ndarray


def root_key(model: str, prefill_tp: int, engine_kind: str, chunk_tokens: int = 0) -> bytes:
    """The chain's start: which computation wrote the K/V (same model, TP, engine kind and
    prefill chunk size)."""
    name = f"{model}|tp{prefill_tp}|{engine_kind}|chunk{chunk_tokens}"
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class Chain:
    """How one prefill peer's K/V is keyed: the chain's root and the engine's unit of prefix
    stability in tokens."""

    root: bytes
    unit: int


def chain_of(link: PeerLink, host: EngineHost) -> Chain | None:
    """The chain for K/V READ from `link`'s prefill engine (its model fingerprint, TP and chunk
    size; the engine kind is assumed equal on both sides, as the services pair them); None: that
    engine's K/V of a prefix is not stable, nothing of it is cached."""
    chunk = link.remote.prefill_chunk_tokens
    unit = host.engine.prefix_stable_unit(chunk)
    if unit is None:
        return None
    return Chain(root_key(link.remote.model.fingerprint, link.remote.tp_size, type(host.engine).__name__, chunk), unit)


def reach(block: int, block_size: int, unit: int) -> int:
    """Tokens the K/V of block `block` depend on: up to the end of the last unit it touches."""
    return -(-(block + 1) * block_size // unit) * unit


def cacheable_blocks(computed: int, block_size: int, unit: int) -> int:
    """Leading full blocks whose reach lies within `computed` tokens."""
    return computed // unit * unit // block_size


def skipped_bytes(link: PeerLink, tokens: int) -> int:
    """K/V bytes the READs would have moved for the first `tokens` tokens."""
    return sum(pair.lists.bytes_for(tokens, False)[0] for pair in link.pairs) if tokens else 0


def chain_keys(root: bytes, tokens: Sequence[int], block_size: int, num_blocks: int, unit: int = 1) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks of `tokens`: each hashes the previous key and
    the tokens after the previous block's reach up to its own (at unit 1: the block's tokens),
    so a key names every token its block's K/V depend on. The blocks' reach must lie within
    `tokens` (`cacheable_blocks`)."""
    keys: list[bytes] = []
    previous, start = root, 0
    ids = np.asarray(tokens[: reach(num_blocks - 1, block_size, unit) if num_blocks else 0], dtype=np.int64)
    for b in range(num_blocks):
        end = reach(b, block_size, unit)
        if end > len(ids):
            raise ValueError(f"block {b} depends on {end} tokens, only {len(ids)} given")
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(ids[start:end].tobytes())
        previous, start = h.digest(), end
        keys.append(previous)
    return keys


@dataclass
class _Entry:
    key: bytes
    blocks: tuple[int, ...]  # the block id in each attention group, in group order
    digests: tuple[SectionDigest, ...]  # FA digests of this block's K/V on our ranks (empty: digests off)
    users: int = 0  # requests using it now: never evicted while > 0
    dropped: bool = False  # found corrupt: out of the index, freed when the last user ends

    @property
    def holder(self) -> str:
        return f"prefix-cache:{self.key.hex()}"


@dataclass
class Hit:
    """The leading cached blocks one request uses; pinned until `release`."""

    entries: list[_Entry] = field(default_factory=list)
    block_size: int = 0
    chain: Chain | None = None
    _cache: PrefixCache | None = None

    @property
    def tokens(self) -> int:
        return len(self.entries) * self.block_size

    def leading(self, groups: Sequence[str]) -> list[IntArray]:
        """Per group of the layout (`kind` of each): the cached block ids to put first."""
        attention = [g for g, kind in enumerate(groups) if kind == "attention"]
        out = [np.empty(0, dtype=np.int64) for _ in groups]
        for i, g in enumerate(attention):
            out[g] = np.array([e.blocks[i] for e in self.entries], dtype=np.int64)
        return out

    def release(self) -> None:
        if self._cache is not None:
            self._cache.unpin(self)
            self._cache = None


class PrefixCache:
    def __init__(self, host: EngineHost, capacity_blocks: int, observer: Observer | None = None) -> None:
        self.host = host
        self.capacity_blocks = capacity_blocks
        self.observer = observer or Observer()
        self.kinds = [g.kind for g in host.layout.groups]
        self._attention = [g for g, kind in enumerate(self.kinds) if kind == "attention"]
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        # Whether anything may be cached; what is depends on each prefill peer (`chain_of`).
        self.enabled = capacity_blocks > 0 and bool(self._attention)

    @property
    def block_size(self) -> int:
        return self.host.layout.block_size

    @property
    def num_blocks(self) -> int:
        return len(self._entries) * len(self._attention)

    def lookup(self, chain: Chain | None, prompt: Sequence[int], computed: int) -> Hit:
        """The longest run of cached leading blocks of `prompt` whose reach lies within its
        `computed` tokens, pinned."""
        hit = Hit(self._leading(chain, prompt, computed), block_size=self.block_size, chain=chain, _cache=self)
        for entry in reversed(hit.entries):  # the head most recent: tails are evicted first
            entry.users += 1
            self._entries.move_to_end(entry.key)
        self.observer.count(Count.PREFIX_CACHE_HIT if hit.entries else Count.PREFIX_CACHE_MISS)
        return hit

    def cached_blocks(self, chain: Chain | None, prompt: Sequence[int], computed: int) -> int:
        """How many leading blocks `lookup` would find: nothing pinned, touched or counted."""
        return len(self._leading(chain, prompt, computed))

    def _leading(self, chain: Chain | None, prompt: Sequence[int], computed: int) -> list[_Entry]:
        if not self.enabled or chain is None:
            return []
        size, found = self.block_size, []
        for key in chain_keys(chain.root, prompt, size, cacheable_blocks(computed, size, chain.unit), chain.unit):
            entry = self._entries.get(key)
            if entry is None:
                break
            found.append(entry)
        return found

    def unpin(self, hit: Hit) -> None:
        for entry in hit.entries:
            entry.users -= 1
            if entry.dropped and entry.users == 0:
                self._free(entry)

    def reclaim(self, n: int) -> int:
        """Free up to `n` blocks of unused entries, least recently used first; how many freed."""
        freed = 0
        for entry in [e for e in self._entries.values() if e.users == 0]:
            if freed >= n:
                break
            del self._entries[entry.key]
            freed += self._free(entry)
        return freed

    def discard(self, hit: Hit) -> None:
        """Drop a hit's entries (found corrupt): no lookup finds them again, and their blocks
        are freed once no request uses them."""
        for entry in hit.entries:
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
                entry.dropped = True

    def _free(self, entry: _Entry) -> int:
        freed = self.host.free(entry.holder)
        self.observer.count(Count.PREFIX_CACHE_EVICTED, freed)
        return freed

    def _room_for(self, blocks: int) -> bool:
        """Evict unused entries until `blocks` more fit the bound; whether they do."""
        over = self.num_blocks + blocks - self.capacity_blocks
        if over > 0:
            self.reclaim(over)
        return self.num_blocks + blocks <= self.capacity_blocks

    def unshare(self, hit: Hit, blocks: RequestBlocks) -> RequestBlocks:
        """The request's blocks with fresh ones (its own) in place of the hit's: prefill sent the
        whole state after all (it ignored the cached count), and a READ must never write into
        blocks other requests use. The hit is released."""
        n = len(hit.entries)
        if not n:
            return blocks
        ids = self.host.take(blocks.request_id, n * len(self._attention))
        out = list(blocks.block_ids)
        for i, g in enumerate(self._attention):
            out[g] = np.concatenate([ids[i * n : (i + 1) * n], blocks.block_ids[g][n:]])
        hit.release()
        hit.entries = []
        return RequestBlocks(blocks.request_id, out)

    def candidates(self, chain: Chain | None, prompt: Sequence[int], computed: int, hit: Hit) -> list[tuple[int, bytes]]:
        """(block index, key) of the request's cacheable prompt blocks after its hit not cached yet."""
        if not self.enabled or chain is None:
            return []
        size = self.block_size
        keys = chain_keys(chain.root, prompt, size, cacheable_blocks(computed, size, chain.unit), chain.unit)
        return [(i, k) for i, k in enumerate(keys) if i >= len(hit.entries) and k not in self._entries]

    def insert(
        self, blocks: RequestBlocks, new: Sequence[tuple[int, bytes]], digests: Sequence[tuple[SectionDigest, ...]]
    ) -> int:
        """Take the request's blocks `new` (index, key) from it, with their digests; how many entered."""
        entered = 0
        per_entry = len(self._attention)
        for (i, key), own in zip(new, digests):
            if key in self._entries or not self._room_for(per_entry):
                continue
            ids = tuple(int(blocks.block_ids[g][i]) for g in self._attention)
            entry = _Entry(key, ids, own)
            self.host.allocator.transfer(blocks.request_id, entry.holder, np.array(ids, dtype=np.int64))
            self._entries[key] = entry
            entered += 1
        return entered

    def block_digests(self, blocks: RequestBlocks, indices: Sequence[int]) -> list[tuple[SectionDigest, ...]]:
        """On the compute thread: the FA digests of each given full block of the request's prompt."""
        if not self.host.verify_transfer:
            return [() for _ in indices]
        return block_digests(self.host.layout, self.host.views, blocks.block_ids, indices)

    def verify(self, hit: Hit, blocks: RequestBlocks) -> list[int]:
        """On the compute thread: indices of the hit's blocks whose bytes differ from their digests."""
        if not self.host.verify_transfer:
            return []
        got = self.block_digests(blocks, range(len(hit.entries)))
        return [i for i, (e, d) in enumerate(zip(hit.entries, got)) if compare_digests(self.host.layout, e.digests, d)]
