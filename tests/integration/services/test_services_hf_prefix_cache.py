"""Decode's prefix cache (--prefix-cache-blocks) with the hf engine. One transformers forward
over a whole prompt may round a prefix's K/V differently for every prompt length, so without
chunks nothing is cached. With --prefill-chunk-tokens C prefill runs chunks of C tokens from
token 0 on one cache (EngineLayout.prefill_chunk_tokens tells decode C at the handshake): a
block's K/V are reused only when every chunk it lies in is whole and made of the same tokens
(`Engine.prefix_stable_unit`, decode_svc/prefix_cache.py), so they are bit for bit what the
next turn's prefill computes.

Real services in this process (grpc.aio on port 0, NIXL READs over UCX on DRAM), tiny seeded
checkpoints. Every turn's tokens equal the colocated run with the same chunks bit for bit, with
every digest checked; turns 2+ READ only the K/V after the cached prefix. Negative control: the
K/V of a prompt's last, partial chunk differ from the same tokens' K/V in a whole chunk of a
longer prompt, so caching them (the unit clamp disabled) would reuse other bits; the clamp keeps
them out of the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch

from decode_svc.app import DecodeApp
from decode_svc.prefix_cache import PrefixCache, cacheable_blocks
from shared.cache.model_views import torch_dtype
from shared.engine.hf.checkpoint import HfCheckpoint
from shared.engine.hf.colocated import colocated_generate
from shared.engine.hf.engine import HfEngine
from shared.engine.paged_state import PagedStateStore
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import RequestBlocks
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.integration.services.hf_services import generate_ids, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

CHUNK = 40
ANSWER = 4
CACHE = ("--prefix-cache-blocks", "64", "--prefix-cache-states", "0", "--num-blocks", "128")  # no checkpoints: every turn READs
CHUNKS = ("--prefill-chunk-tokens", str(CHUNK))


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 300, n)]


def _cache(decode: DecodeApp) -> PrefixCache:
    return decode.servicer.generation.reuse.prefix


def _attention_unit_bytes(summary: dpb.GenerateSummary, decode: DecodeApp) -> int:
    """Attention bytes a READ moves per fa unit of tokens (from a turn that READ everything)."""
    link = decode.peers.peers[0].link
    assert link is not None
    unit = link.pairs[0].lists.fa_unit_tokens
    return summary.transfer.attention_bytes // -(-summary.num_transferred_tokens // unit)


def _fa_unit(decode: DecodeApp) -> int:
    link = decode.peers.peers[0].link
    assert link is not None
    return link.pairs[0].lists.fa_unit_tokens


@pytest.mark.parametrize("family,p_tp,d_tp", [("nemotron_h", 1, 1), ("bamba", 1, 2), ("nemotron_h", 2, 1)])
async def test_hf_multi_turn_with_chunks_reuses_whole_chunks_and_equals_colocated(
    hf_checkpoint: Callable[[str], str], family: str, p_tp: int, d_tp: int
) -> None:
    directory = hf_checkpoint(family)
    ckpt = HfCheckpoint(directory, dtype="fp32")
    rng = np.random.default_rng(21)
    prompt = _tokens(20, 100)
    got: list[tuple[list[int], dpb.GenerateSummary]] = []
    prompts: list[list[int]] = []
    async with hf_pair(directory, directory, p_tp, d_tp, prefill_flags=CHUNKS, decode_flags=CACHE) as (
        _,
        decode,
    ):
        block = decode.host.layout.block_size
        for _ in range(4):
            prompts.append(prompt)
            ids, summary = await generate_ids(decode.port, prompt, ANSWER)
            got.append((ids, summary))
            prompt = [*prompt, *ids, *(int(x) for x in rng.integers(4, 300, 45))]
        unit_bytes, fa_unit = _attention_unit_bytes(got[0][1], decode), _fa_unit(decode)
        link = decode.peers.peers[0].link
        assert link is not None and link.remote.prefill_chunk_tokens == CHUNK  # learned at the handshake
        held = _cache(decode).num_blocks
    assert held > 0
    for t, (p, (ids, summary)) in enumerate(zip(prompts, got, strict=True)):
        want = colocated_generate(ckpt, p, ANSWER, prefill_chunk_tokens=CHUNK, stop_at_eos=True).token_ids
        assert ids == want, t
        assert summary.digests_verified, t
    for t, ((_, prev), (_, cur)) in enumerate(itertools.pairwise(got), start=1):
        # The cache holds the previous turn's blocks inside its whole chunks (its prompt is this
        # turn's prefix): nothing of a chunk the previous prompt ended in.
        cached = cacheable_blocks(prev.prompt_token_count, block, CHUNK) * block
        assert cur.prefix_cached_tokens == cached > 0, t
        assert cached <= prev.prompt_token_count // CHUNK * CHUNK, t
        n = cur.num_transferred_tokens
        assert cur.transfer.attention_bytes == unit_bytes * (-(-n // fa_unit) - cached // fa_unit), t
        assert cur.transfer.attention_bytes < got[0][1].transfer.attention_bytes * n / got[0][1].num_transferred_tokens


async def test_hf_without_chunks_caches_nothing(hf_checkpoint: Callable[[str], str]) -> None:
    """One forward over each prompt: no prefix is stable, every turn READs everything."""
    directory = hf_checkpoint("nemotron_h")
    prompt = _tokens(22, 90)
    async with hf_pair(directory, directory, 1, 1, decode_flags=CACHE) as (_, decode):
        first_ids, first = await generate_ids(decode.port, prompt, ANSWER)
        turn = [*prompt, *first_ids, *_tokens(23, 30)]
        again_ids, again = await generate_ids(decode.port, turn, ANSWER)
        held = _cache(decode).num_blocks
    assert held == 0
    ckpt = HfCheckpoint(directory, dtype="fp32")
    assert again_ids == colocated_generate(ckpt, turn, ANSWER, stop_at_eos=True).token_ids
    assert first.prefix_cached_tokens == again.prefix_cached_tokens == 0
    assert again.num_transferred_tokens == again.prompt_token_count
    assert again.state_verified and again.digests_verified


def _chunked_kv(ckpt: HfCheckpoint, prompt: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V `[T, heads, head_dim]` of one attention layer after a prefill in CHUNK-token chunks."""
    cache, at = ckpt.new_cache(), 0
    for end in chunk_ends(0, len(prompt), CHUNK):
        ckpt.forward(prompt[at:end], at, cache)
        at = end
    entry = cache.layers[layer]
    return entry.keys[0].transpose(0, 1), entry.values[0].transpose(0, 1)


def _cached_kv(decode: DecodeApp, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the cache's entries (one chain: a single prompt's blocks, in order) for `tokens`."""
    host, cache = decode.host, _cache(decode)
    entries = list(cache._entries.values())  # TEST-ONLY: the blocks themselves
    groups = [
        np.array([e.blocks[0] for e in entries], dtype=np.int64) if g.kind == "attention" else np.empty(0, np.int64)
        for g in host.layout.groups
    ]
    assert sum(g.kind == "attention" for g in host.layout.groups) == 1
    store = PagedStateStore(host.layout, host.views, RequestBlocks("probe", groups))
    return store.read_kv(layer, tokens)


@pytest.mark.parametrize("clamped", [True, False], ids=["clamped", "unclamped"])
async def test_a_partial_chunk_differs_and_stays_out_of_the_cache(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, clamped: bool
) -> None:
    """A 66-token prompt ends inside its second chunk [40, 66); a longer prompt computes [40, 80)
    as a whole chunk, and on this checkpoint (fp32, CPU) its K/V there are other bits. Clamped,
    the cache holds only blocks inside [0, 40), exactly the longer prompt's bits. Unclamped
    (TEST-ONLY: unit 1, as the reference engine), the cache also takes the block [32, 64), and
    its K/V differ from what the next turn's prefill computes: reusing them would be inexact."""
    if not clamped:
        monkeypatch.setattr(HfEngine, "prefix_stable_unit", lambda self, chunk: 1)
    directory = hf_checkpoint("nemotron_h")
    ckpt = HfCheckpoint(directory, dtype="fp32")
    prompt = _tokens(24, 66)
    longer = [*prompt, *_tokens(25, 70)]
    async with hf_pair(directory, directory, 1, 1, prefill_flags=CHUNKS, decode_flags=CACHE) as (
        _,
        decode,
    ):
        block = decode.host.layout.block_size
        await generate_ids(decode.port, prompt, 2)  # 2: a first token that ends it READs nothing
        layer = decode.host.spec.attention_layers[0]
        tokens = _cache(decode).num_blocks * block
        k, v = _cached_kv(decode, layer, tokens)
    stored = torch_dtype(decode.host.spec.kv_dtype)  # compared at the blocks' precision
    fresh_k, fresh_v = (x.to(stored).to(torch.float32) for x in _chunked_kv(ckpt, longer, layer))
    same = [bool(torch.equal(k[i], fresh_k[i]) and torch.equal(v[i], fresh_v[i])) for i in range(tokens)]
    if clamped:
        assert tokens == cacheable_blocks(len(prompt), block, CHUNK) * block <= CHUNK
        assert all(same)  # exactly the longer prompt's bits
    else:
        assert tokens == len(prompt) // block * block > CHUNK  # blocks into the partial chunk
        assert all(same[:CHUNK]) and not all(same[CHUNK:])  # the partial chunk's K/V differ
