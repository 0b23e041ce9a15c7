"""Decode-side reuse in one request: the wiring between the request and decode's own caches, the
prefix cache (--prefix-cache-blocks, decode_svc/prefix_cache.py) and the state checkpoints
(--prefix-cache-states, decode_svc/state_checkpoints.py).

Before its blocks are allocated a request looks both up under the chosen peer's chain (`lookup`:
each pins what it found, `release` unpins on a failure before the request starts); with no peer
ready, under the chain of a prefill engine decode linked with before that holds a checkpoint of
the prompt (`restorable`), so the request decodes from it while prefill is down. A hit's blocks
lead the request's, the job announces their tokens to a prefill engine that writes the same K/V
(`announced`), and every READ moves only K/V after them. Which blocks the READs write is settled
at the first manifest, part or whole (`read_blocks` on a `ReadTarget`): if prefill skipped
nothing, fresh blocks replace the hit's before any READ, so no READ ever writes blocks the cache
shares. The hit's blocks are checked against the digests they had when they entered (`verify`),
and after the last decode step the request's full prompt blocks READ from prefill enter the
cache (`keep_prefix`).

A checkpoint is taken of what a READ brought, once its digests are checked and before a decode
step changes it (`keep_state`). A request whose computed prompt is exactly one a finished request
READ restores that state into its own blocks (`restored`) and decodes with no job and no READ
(`decode_restored`). At full-N the checkpoint holds the first token prefill drew too: it goes out
first and is fed, as after a manifest, and one that ends the request needs no state restored
(`first_token_only`).

Both keep their blocks in the engine's pool, under holder ids of their own, so an allocation
that finds too few free blocks takes them back (`reclaim`, the engine host's hook): unused state
checkpoints first, least recently used first, then unused prefix cache entries. Checkpoints go
first because they build on the prefix cache and not the other way round: a checkpoint is usable
only while the cache holds its leading blocks, so evicting those first would leave checkpoints
holding memory no lookup can use, while evicting a checkpoint leaves every cached block useful
(the next request with that prompt READs only what follows them). Nothing in use is reclaimed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from decode_svc.peer_link import PeerLink
from decode_svc.prefix_cache import Hit, IntArray, PrefixCache, chain_of, skipped_bytes
from decode_svc.read_checks import StateChecks
from decode_svc.reader import ReadStats
from decode_svc.request import RequestContext
from decode_svc.responses import ClientStream, Transfer, client_stream, summary
from decode_svc.state_checkpoints import Checkpoint, Compute, StateCheckpoints
from shared.cache.manifest import Manifest
from shared.engine.logprobs import TokenLogprobs
from shared.engine.protocol import RequestBlocks
from shared.engine.stopping import FinishReason
from shared.errors import DataLoss, Internal
from shared.observe import Count, Observer
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.runtime import faults
from shared.runtime.engine_host import EngineHost

# Generation's decode steps of the request: (computed prompt tokens in its blocks, the stream
# they go to, the first token already sent at full-N) -> the token chunks.
Steps = Callable[[int, ClientStream, int | None, "ForkFirsts"], AsyncIterator[pb.GenerateResponse]]
"""Decode steps from the state after `num_computed` tokens, streamed through a ClientStream,
after the first token (full-N) and, for a request of several sequences, the other sequences'
first tokens (ForkFirsts, full-N; empty at n-1)."""
ForkFirsts = tuple[tuple[int, ...], tuple[TokenLogprobs, ...]]
NO_FORKS: ForkFirsts = ((), ())


@dataclass
class Reused:
    """What decode's own caches hold for one request, pinned while it runs: the prefix cache's
    hit and a state checkpoint of exactly its computed prompt (None: none held), both looked up
    under `link`'s chain (None: a P/D decode leg, which looks nothing up). `link` may be that of
    a session since lost, closed: the restore path reads only its layout, never through NIXL."""

    hit: Hit = field(default_factory=Hit)
    state: Checkpoint | None = None
    link: PeerLink | None = None


@dataclass
class ReadTarget:
    """The blocks a request's READs write: its own, led by the prefix cache's hit, until a
    manifest says prefill sent the whole state after all (then fresh ones in the hit's place)."""

    blocks: RequestBlocks


# With no --prefix-cache-blocks: the prefix cache may keep up to this share of the cache's blocks.
# It holds only blocks no request asked for (any request short of blocks takes them back, least
# recently used first), so the share bounds what a turn-2 request can find, not what requests get.
DEFAULT_PREFIX_CACHE_SHARE = 0.25


def engine_may_reuse(host: EngineHost) -> bool:
    """Whether the engine's prefix K/V can be stable for some prefill chunk size (reference: any;
    hf: with chunks; synthetic: never, its patterns are seeded by the whole prompt)."""
    return any(host.engine.prefix_stable_unit(chunk) is not None for chunk in (0, host.layout.block_size))


def reuse_sizes(prefix_cache_blocks: int | None, prefix_cache_states: int | None, host: EngineHost) -> tuple[int, int]:
    """(prefix cache blocks, state checkpoints): as given, else the defaults. Blocks: a quarter of
    the cache for an engine whose prefix can be stable, else 0. Checkpoints: as many as those blocks
    hold at about one block per KV-cache group each (every Mamba group's block, the attention
    groups' last, partly filled one), at least 1; none without the prefix cache."""
    blocks = prefix_cache_blocks
    if blocks is None:
        blocks = int(host.num_blocks * DEFAULT_PREFIX_CACHE_SHARE) if engine_may_reuse(host) else 0
    states = prefix_cache_states
    if states is None:
        states = max(1, blocks // max(1, len(host.layout.groups))) if blocks else 0
    return blocks, states


class DecodeReuse:
    """Decode's prefix cache and state checkpoints, as one request's path uses them."""

    def __init__(
        self,
        host: EngineHost,
        checks: StateChecks,
        prefix_cache_blocks: int,
        prefix_cache_states: int,
        observer: Observer,
    ) -> None:
        self.host = host
        self.checks = checks
        self.observer = observer
        self.prefix = PrefixCache(host, prefix_cache_blocks, observer)
        self.states = StateCheckpoints(host, prefix_cache_states, observer)
        if self.prefix.enabled or self.states.enabled:
            host.reclaim = self.reclaim

    def reclaim(self, n: int) -> int:
        """Free up to `n` blocks of unused entries: state checkpoints first (least recently used
        first), then prefix cache entries (likewise); how many freed."""
        freed = self.states.reclaim(n)
        if freed < n:
            freed += self.prefix.reclaim(n - freed)
        return freed

    def lookup(self, link: PeerLink, req: RequestContext) -> Reused:
        """The prefix cache's hit for the prompt on `link`'s chain, then the checkpoint of its
        computed tokens that the hit leads (at full-N: drawn as `req.sampling` draws), pinned."""
        computed = self.host.engine.num_prefill_tokens(len(req.prompt))
        chain = chain_of(link, self.host)
        hit = self.prefix.lookup(chain, req.prompt, computed)
        if not self._restores(req):
            return Reused(hit, None, link)
        return Reused(hit, self.states.lookup(chain, req.prompt, computed, hit, req.sampling), link)

    def _restores(self, req: RequestContext) -> bool:
        """A checkpoint keeps no prompt logprobs, and at full-N keeps its first token but not
        that token's logprobs: a request that asks for them takes the job instead."""
        return req.n == 1 and req.prompt_logprobs is None and (req.logprobs is None or not self.states.full)

    def restorable(self, links: Sequence[PeerLink], req: RequestContext) -> PeerLink | None:
        """The first of `links` under whose chain `lookup` finds a state checkpoint of the prompt
        (with its prefix cache lead), for a request no prefill engine is ready to take; nothing
        pinned or counted until that `lookup`."""
        computed = self.host.engine.num_prefill_tokens(len(req.prompt))
        if not self._restores(req):
            return None
        for link in links:
            chain = chain_of(link, self.host)
            lead = self.prefix.cached_blocks(chain, req.prompt, computed)
            if self.states.holds(chain, req.prompt, computed, lead, req.sampling):
                return link
        return None

    def leading(self, reused: Reused) -> list[IntArray] | None:
        """The hit's blocks, to lead the request's own (None: no hit)."""
        hit = reused.hit
        return hit.leading(self.prefix.kinds) if hit.entries else None

    def release(self, reused: Reused) -> None:
        """Unpin both at once: the request failed before any model call could read them."""
        reused.hit.release()
        self.release_state(reused)

    def release_state(self, reused: Reused) -> None:
        """Unpin the checkpoint (the hit's blocks are released once no model call reads them)."""
        if reused.state is not None:
            self.states.release(reused.state)

    def announced(self, reused: Reused, link: PeerLink) -> int:
        """The prompt tokens the job tells `link`'s prefill engine decode holds: the hit's, only
        to an engine that writes the same K/V (a retry may go to another)."""
        hit = reused.hit
        return hit.tokens if hit.entries and hit.chain == chain_of(link, self.host) else 0

    def read_blocks(self, manifest: Manifest, reused: Reused, target: ReadTarget, peer: str) -> RequestBlocks:
        """The blocks to READ into: with the hit's where prefill skipped its tokens, else fresh ones
        (a prefill that ignored the cached count, or another engine after a retry). Called for
        every manifest (each part, then the last): the first one decides, later ones agree."""
        hit = reused.hit
        if manifest.skipped_tokens == hit.tokens:
            return target.blocks
        if manifest.skipped_tokens:
            raise Internal(
                f"prefill {peer} skipped {manifest.skipped_tokens} prompt tokens; this decode engine holds {hit.tokens}",
                field="manifest.skipped_prompt_tokens",
                reason="BAD_MANIFEST",
            )
        target.blocks = self.prefix.unshare(hit, target.blocks)
        return target.blocks

    async def verify(self, run: Compute, req: RequestContext, reused: Reused, local: RequestBlocks) -> None:
        """The prefix cache's blocks must still have the digests they had when they entered
        (prefill's digests cover only what was READ); a corrupt entry leaves the cache."""
        hit = reused.hit
        if not hit.entries:
            return
        bad = await run(lambda: self.prefix.verify(hit, local))
        if bad:
            self.prefix.discard(hit)
            raise DataLoss(
                f"request {req.request_id}: {len(bad)} of the {len(hit.entries)} prefix cache blocks it reused differ "
                f"from their digests (first: block {bad[0]} of the prompt); they left the cache",
                field="prompt_token_ids",
                reason="PREFIX_CACHE_MISMATCH",
            )

    async def keep_state(
        self, run: Compute, req: RequestContext, transfer: Transfer, local: RequestBlocks, reused: Reused, first_token: int | None
    ) -> None:
        """A state checkpoint of what was just READ and checked, before a decode step changes it;
        not of a P/D leg's full-N state: its prefill leg drew the first token with its own body."""
        link, manifest = transfer.link, transfer.manifest
        assert manifest is not None
        if req.remote is not None and first_token is not None:
            return
        state_bytes = transfer.stats.conv_bytes + transfer.stats.ssm_bytes
        chain = reused.hit.chain or chain_of(link, self.host)
        await self.states.keep(
            run, chain, link, req.prompt, local, manifest.num_computed_tokens, state_bytes, req.sampling, first_token
        )

    async def keep_prefix(
        self,
        run: Compute,
        req: RequestContext,
        reused: Reused,
        local: RequestBlocks,
        link: PeerLink,
        num_computed: int,
        skipped: int,
    ) -> None:
        """A finished request's full prompt blocks READ from prefill go to the prefix cache."""
        hit = reused.hit
        if skipped:
            self.observer.count(Count.PREFIX_CACHE_SAVED_BYTES, skipped_bytes(link, skipped))
        new = self.prefix.candidates(hit.chain or chain_of(link, self.host), req.prompt, num_computed, hit)
        if not new:
            return
        digests = await run(lambda: self.prefix.block_digests(local, [i for i, _ in new]))
        self.prefix.insert(local, new, digests)

    def first_token_only(self, req: RequestContext, reused: Reused, ended: FinishReason) -> list[pb.GenerateResponse]:
        """A full-N checkpoint whose first token ends the request (a stop token, max_tokens 1):
        the token and the summary; nothing restored, no job, nothing READ (nor saved: a prefill
        job would not have READ either)."""
        state, link = reused.state, reused.link
        assert state is not None and state.first_token is not None and link is not None
        out = client_stream(self.host, req, self.observer)
        responses = [out.chunk([state.first_token])]
        tail = out.tail()
        if tail is not None:
            responses.append(tail)
        transfer = Transfer(link, None, ReadStats(), 0.0, restored=True)
        responses.append(summary(req, out, ended, transfer, self.checks, transferred=0, read=False, cached_tokens=state.computed))
        return responses

    async def restored(self, run: Compute, reused: Reused, local: RequestBlocks) -> bool:
        """The checkpoint copied into the request's own blocks; False when the copy lacks its
        digests (the checkpoint discarded): the request then takes the ordinary job and READ."""
        assert reused.state is not None
        return await self.states.restored(run, reused.state, local)

    async def decode_restored(
        self, req: RequestContext, reused: Reused, local: RequestBlocks, run: Compute, steps: Steps
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Decode from a restored state checkpoint, as after a READ: no prefill job, nothing READ.
        At full-N its first token goes out first, then decoding continues by feeding it."""
        state, link = reused.state, reused.link
        assert state is not None and link is not None
        out = client_stream(self.host, req, self.observer)
        first = state.first_token
        if first is not None:
            yield out.chunk([first])  # before the checks and any decode step, as after a manifest
        await faults.pause("after_read", req.request_id)
        checking = time.monotonic()
        if self.host.verify_transfer:
            await self.verify(run, req, reused, local)
        if self.checks.check_state:
            await self.checks.recompute(run, req.prompt, state.computed, local, link)
        digest_check_seconds = time.monotonic() - checking
        self.observer.count(Count.PREFIX_STATE_SAVED_BYTES, state.saved_bytes)
        async for chunk in steps(state.computed, out, first, NO_FORKS):
            yield chunk
        await self.keep_prefix(run, req, reused, local, link, state.computed, reused.hit.tokens)
        tail = out.tail()
        if tail is not None:
            yield tail
        assert out.finish is not None
        yield summary(
            req,
            out,
            out.finish,
            Transfer(link, None, ReadStats(), 0.0, restored=True),
            self.checks,
            transferred=0,
            digest_check_seconds=digest_check_seconds,
            cached_tokens=state.computed,
        )
