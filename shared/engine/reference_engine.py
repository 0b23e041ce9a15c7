"""The reference hybrid model behind the `Engine` protocol, on the paged, TP-sharded caches.

Prefill runs the model's step loop over the first N-1 prompt tokens (SSM state cannot be rolled
back, so decode recomputes the last prompt token: the N-1 boundary), writing every rank's shard;
decode continues from whatever state sits in its own blocks. The math always runs on the
unsharded state, so tokens cannot depend on either side's TP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shared.cache.model_views import RankViews
from shared.engine.logprobs import TokenLogprobs
from shared.engine.paged_state import PagedStateStore
from shared.engine.prompt_logprobs import score_rows
from shared.engine.protocol import DecodeSession, EnsureCapacity, RequestBlocks
from shared.engine.reference.colocated import DEFAULT_SEED, cached_model
from shared.engine.reference.model import greedy
from shared.engine.reference.state_store import read_global_state
from shared.engine.sampling import GREEDY, SamplingParams, masked, sample
from shared.layout import boundary
from shared.layout.boundary import Boundary
from shared.layout.page import EngineLayout


class ReferenceDecodeSession:
    def __init__(
        self,
        engine: ReferenceEngine,
        prompt: Sequence[int],
        num_computed: int,
        store: PagedStateStore,
        ensure_capacity: EnsureCapacity,
        sampling: SamplingParams,
    ) -> None:
        self._engine = engine
        self._store = store
        self._ensure = ensure_capacity
        self._sampling = sampling
        self._index = 0  # output index of the next token (its sampling draw)
        self._pending = list(prompt[num_computed:])  # prompt tokens decode still has to compute
        self._pos = num_computed
        self._last: int  # the last sampled token, set by the first step
        self.last_logits: torch.Tensor | None = None  # what the last step drew from (logprobs)
        if not self._pending:
            raise ValueError("decode needs at least the last prompt token to compute")

    def _step(self, token: int) -> torch.Tensor:
        self._store.blocks = self._ensure(self._pos + 1)
        logits = self._engine.model.step(token, self._pos, self._store)
        self._pos += 1
        return logits

    def step(self) -> int:
        logits = None
        while self._pending:
            logits = self._step(self._pending.pop(0))
        if logits is None:
            logits = self._step(self._last)
        # Greedy keeps the model's own tie rule; sampling draws as every engine does.
        s, i = self._sampling, self._index
        self._last = greedy(masked(logits, s, i)) if s.greedy else sample(logits, s, i)
        self._index += 1
        self.last_logits = logits
        return self._last


class ReferencePrefillRun:
    """A prefill in chunks: the same steps `prefill` runs, so any chunking gives the same bits."""

    def __init__(self, engine: ReferenceEngine, prompt: Sequence[int], store: PagedStateStore) -> None:
        self._engine, self._prompt, self._store = engine, list(prompt), store
        self._tokens = self._prompt[: engine.num_prefill_tokens(len(prompt))]
        self._pos = 0
        self.prompt_logprobs: list[TokenLogprobs] = []
        self._score: int | None = None  # prompt logprobs' top count (None: none kept)

    def score_prompt(self, k: int) -> None:
        self._score = k

    def compute(self, end: int, on_layer: Callable[[int], None] | None = None) -> None:
        if not self._pos < end <= len(self._tokens):
            raise ValueError(f"chunk [{self._pos}, {end}) outside the {len(self._tokens)} tokens prefill computes")
        if self._pos == 0:
            self._store.reset_ssm()  # its blocks may still hold an earlier request's state
        # Layer parts: only the last token's step leaves a layer's state final, layer by layer.
        report = on_layer if end == len(self._tokens) else None
        model, score = self._engine.model, self._score
        if score is None:
            model.prefill(self._tokens[self._pos : end], self._store, start_pos=self._pos, on_layer=report)
        else:  # `model.prefill`'s steps, each one's logits scored
            for pos in range(self._pos, end):
                logits = model.step(self._tokens[pos], pos, self._store, report if pos == end - 1 else None)
                self.prompt_logprobs += score_rows(self._prompt, pos, logits.reshape(1, -1), score)
        self._pos = end


class ReferenceEngine:
    eos_token_ids: frozenset[int] = frozenset()  # byte-level tiny models: no EOS
    samples = True
    tokenizer = None  # the byte tokenizer
    boundary: Boundary = "n-1"
    exact_chunk_tokens: int | None = None  # a per-token step loop: any chunking, the same bits

    def __init__(self, layout: EngineLayout, ranks: Sequence[RankViews], seed: int = DEFAULT_SEED) -> None:
        self.spec = layout.spec
        self.layout = layout
        self.ranks = list(ranks)
        device = str(self.ranks[0].cache.device) if self.ranks else "cpu"
        self.model = cached_model(self.spec, seed, device)

    def prefix_stable_unit(self, prefill_chunk_tokens: int) -> int | None:
        # K/V of position i: a per-token projection of the layer input, causal (tokens <= i
        # only), in a per-token step loop: any prefix, however prefill chunks.
        return 1

    def num_prefill_tokens(self, prompt_len: int) -> int:
        return boundary.num_prefill_tokens(self.spec, prompt_len)

    def _store(self, blocks: RequestBlocks) -> PagedStateStore:
        return PagedStateStore(self.layout, self.ranks, blocks)

    def prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> None:
        store = self._store(blocks)
        store.reset_ssm()  # its blocks may still hold an earlier request's state
        self.model.prefill(list(prompt[: self.num_prefill_tokens(len(prompt))]), store)

    def start_prefill(
        self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY
    ) -> ReferencePrefillRun:
        return ReferencePrefillRun(self, prompt, self._store(blocks))

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
        return ReferenceDecodeSession(self, prompt, num_computed, self._store(blocks), ensure_capacity, sampling)

    def check_state(
        self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, *, chunk_tokens: int | None = None
    ) -> list[str]:
        """Recompute the prefix on a dense store and compare the unsharded state byte for byte
        (a per-token step loop: any chunking, the same bits)."""
        store = self._store(blocks)
        dense = self.model.new_store()
        self.model.prefill(list(prompt[:num_computed]), dense)
        expected = read_global_state(dense, self.spec, num_computed)
        got = read_global_state(store, self.spec, num_computed)
        problems = store.replica_mismatches(num_computed)
        for layer, (k, v) in expected.kv.items():
            gk, gv = got.kv[layer]
            if not (torch.equal(k, gk) and torch.equal(v, gv)):
                problems.append(f"layer {layer}: K/V differ from the prefill computation")
        for layer, (conv, ssm) in expected.ssm.items():
            gc, gs = got.ssm[layer]
            if not torch.equal(conv, gc):
                problems.append(f"layer {layer}: conv state differs from the prefill computation")
            if not torch.equal(ssm, gs):
                problems.append(f"layer {layer}: SSM state differs from the prefill computation")
        return problems
