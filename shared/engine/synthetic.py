"""The synthetic engine: real-model-sized state filled with a verifiable deterministic pattern.

No model math. Prefill writes, for every layer, K/V of the first N-1 prompt tokens and the conv
and SSM state, drawn from a generator seeded by (prompt, layer, kind; for K/V also the tile of
`KV_TILE_TOKENS` positions). The values are defined on the GLOBAL (unsharded) state, so they do
not depend on TP, and decode can regenerate them and check every byte it received, whatever the
two sides' TP sizes and block sizes. K/V is drawn per tile of positions, so a prefill in chunks
of any size writes the same bytes as one pass (pipelined transfer at real-model sizes). Tokens
are derived from a checksum of the state decode holds, so corrupted bytes change them too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from shared.cache.model_views import RankViews, torch_dtype
from shared.engine.paged_state import PagedStateStore
from shared.engine.protocol import DecodeSession, EnsureCapacity, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams
from shared.layout import boundary
from shared.layout.boundary import Boundary
from shared.layout.page import EngineLayout
from shared.layout.shapes import global_conv_dim, global_ssm_shape

# Positions per K/V draw: a position's K/V is the same whatever range a call asks for, and a
# decode step draws one tile, not the whole prompt.
KV_TILE_TOKENS = 16


def _seed(prompt: Sequence[int], *parts: object) -> int:
    h = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8)
    h.update(repr(parts).encode())
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


class SyntheticPrefillRun:
    """A prefill in chunks: K/V of each chunk's positions, the conv and SSM state with the last
    (which writes layer by layer: each layer's K/V, then its conv and SSM state)."""

    def __init__(self, engine: SyntheticEngine, prompt: list[int], store: PagedStateStore) -> None:
        self._engine, self._prompt, self._store = engine, prompt, store
        self._computed = engine.num_prefill_tokens(len(prompt))
        self._pos = 0

    def compute(self, end: int, on_layer: Callable[[int], None] | None = None) -> None:
        start, engine = self._pos, self._engine
        if not start < end <= self._computed:
            raise ValueError(f"chunk [{start}, {end}) outside the {self._computed} tokens prefill computes")
        if end < self._computed:
            engine.write_kv(self._prompt, self._store, start, end)
            self._pos = end
            return
        self._pos = end
        # The bytes of write_kv + write_ssm, layer by layer (each layer's are its own).
        spec, prompt, store = engine.spec, self._prompt, self._store
        for layer in range(spec.num_layers):
            if layer in spec.attention_layers:
                store.write_kv_range(layer, start, *engine.expected_kv(prompt, layer, start, end - start))
            if layer in spec.ssm_layers:
                store.write_ssm(layer, *engine.expected_ssm(prompt, layer))
            if on_layer is not None:
                on_layer(layer)


class SyntheticEngine:
    eos_token_ids: frozenset[int] = frozenset()
    samples = False  # tokens come from a state checksum, not logits: greedy only
    boundary: Boundary = "n-1"
    tokenizer = None  # the byte tokenizer
    exact_chunk_tokens: int | None = None  # K/V drawn per position tile: any chunking, the same bytes

    def __init__(self, layout: EngineLayout, ranks: Sequence[RankViews]) -> None:
        self.spec = layout.spec
        self.layout = layout
        self.ranks = list(ranks)
        spec = self.spec
        self._kv_shape = (spec.attention.num_kv_heads, spec.attention.head_dim)
        self._conv_shape = (global_conv_dim(spec), layout.shapes.conv_rows)
        self._ssm_shape = global_ssm_shape(spec)
        self._kv_dtype = torch_dtype(spec.kv_dtype)
        self._conv_dtype = torch_dtype(spec.conv_dtype)
        self._ssm_dtype = torch_dtype(spec.ssm_dtype)

    def _pattern(self, shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
        """Random normal values, rounded through the cache dtype (so a round trip is exact)."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(tuple(shape), generator=g).to(dtype).to(torch.float32)

    def expected_kv(self, prompt: Sequence[int], layer: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, start + count), `[count, kv heads, head_dim]` each."""
        first, last = start // KV_TILE_TOKENS, (start + count - 1) // KV_TILE_TOKENS
        shape = (2, KV_TILE_TOKENS, *self._kv_shape)
        tiles = [self._pattern(shape, self._kv_dtype, _seed(prompt, "kv", layer, t)) for t in range(first, last + 1)]
        kv = torch.cat(tiles, dim=1)[:, start - first * KV_TILE_TOKENS :][:, :count]
        return kv[0], kv[1]

    def expected_ssm(self, prompt: Sequence[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv = self._pattern(self._conv_shape, self._conv_dtype, _seed(prompt, "conv", layer))
        ssm = self._pattern(self._ssm_shape, self._ssm_dtype, _seed(prompt, "ssm", layer))
        return conv, ssm

    def prefix_stable_unit(self, prefill_chunk_tokens: int) -> int | None:
        return None  # K/V patterns are seeded by the whole prompt

    def num_prefill_tokens(self, prompt_len: int) -> int:
        return boundary.num_prefill_tokens(self.spec, prompt_len)

    def write_kv(self, prompt: Sequence[int], store: PagedStateStore, start: int, end: int) -> None:
        if end <= start:
            return
        for layer in self.spec.attention_layers:
            store.write_kv_range(layer, start, *self.expected_kv(prompt, layer, start, end - start))

    def write_ssm(self, prompt: Sequence[int], store: PagedStateStore) -> None:
        for layer in self.spec.ssm_layers:
            store.write_ssm(layer, *self.expected_ssm(prompt, layer))

    def prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> None:
        store = PagedStateStore(self.layout, self.ranks, blocks)
        self.write_kv(prompt, store, 0, self.num_prefill_tokens(len(prompt)))
        self.write_ssm(prompt, store)

    def start_prefill(
        self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY
    ) -> SyntheticPrefillRun:
        return SyntheticPrefillRun(self, list(prompt), PagedStateStore(self.layout, self.ranks, blocks))

    def start_decode(
        self,
        prompt: Sequence[int],
        num_computed: int,
        blocks: RequestBlocks,
        ensure_capacity: EnsureCapacity,
        *,
        sampling: SamplingParams = GREEDY,
        first_token: int | None = None,
    ) -> DecodeSession:
        if first_token is not None:
            raise ValueError("first_token: this engine runs the n-1 boundary only (decode computes the last prompt token)")
        if not sampling.greedy:
            raise ValueError("temperature: the synthetic engine decodes greedily only (it has no logits)")
        return SyntheticDecodeSession(self, prompt, num_computed, blocks, ensure_capacity)

    def check_state(
        self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, *, chunk_tokens: int | None = None
    ) -> list[str]:
        store = PagedStateStore(self.layout, self.ranks, blocks)
        problems = store.replica_mismatches(num_computed)
        for layer in self.spec.attention_layers:
            if not num_computed:
                continue
            k, v = store.read_kv(layer, num_computed)
            ek, ev = self.expected_kv(prompt, layer, 0, num_computed)
            bad = (~((k == ek) & (v == ev)).reshape(num_computed, -1).all(dim=1)).nonzero()
            if bad.numel():
                problems.append(f"layer {layer}: K/V of {bad.numel()} positions differ (first at {int(bad[0])})")
        for layer in self.spec.ssm_layers:
            conv, ssm = store.read_ssm(layer)
            econv, essm = self.expected_ssm(prompt, layer)
            if not torch.equal(conv, econv):
                rows = (~(conv == econv).all(dim=1)).nonzero()
                problems.append(f"layer {layer}: conv state differs in {rows.numel()} channels (first {int(rows[0])})")
            if not torch.equal(ssm, essm):
                problems.append(f"layer {layer}: SSM state differs")
        return problems


class SyntheticDecodeSession:
    def __init__(
        self,
        engine: SyntheticEngine,
        prompt: Sequence[int],
        num_computed: int,
        blocks: RequestBlocks,
        ensure_capacity: EnsureCapacity,
    ) -> None:
        self._engine = engine
        self._prompt = list(prompt)
        self._pos = num_computed
        self._ensure = ensure_capacity
        self._store = PagedStateStore(engine.layout, engine.ranks, blocks)
        self._count = 0
        # The checksum reads the state decode holds: a corrupted transfer changes every token.
        total = 0.0
        for layer in engine.spec.ssm_layers:
            conv, ssm = self._store.read_ssm(layer)
            total += float(conv.double().sum()) + float(ssm.double().sum())
        for layer in engine.spec.attention_layers:
            if num_computed:
                k, v = self._store.read_kv(layer, num_computed)
                total += float(k.double().sum()) + float(v.double().sum())
        self._checksum = int(hashlib.blake2b(repr(total).encode(), digest_size=8).hexdigest(), 16)

    def step(self) -> int:
        # Like a real decode step: write K/V of the position being computed (growing blocks).
        self._store.blocks = self._ensure(self._pos + 1)
        for layer in self._engine.spec.attention_layers:
            k, v = self._engine.expected_kv(self._prompt, layer, self._pos, 1)
            self._store.write_kv_range(layer, self._pos, k, v)
        self._pos += 1
        token = (self._checksum + 7919 * self._count) % self._engine.spec.vocab_size
        self._count += 1
        return token
