"""The `hf` engine: real Hugging Face hybrid checkpoints, run by transformers, on the paged caches.

Prefill runs ONE forward over the prompt and writes every attention layer's K/V and every SSM
layer's conv and recurrent state into the request's blocks, sharded per TP rank by the
layout's index functions (`PagedStateStore`). Decode reads the state back from its own blocks,
rebuilds a transformers cache from it and continues. Compute always runs unsharded, in one
process per side; TP only decides where the bytes live.

Two boundaries (`boundary`):
- "full" (the default): prefill computes all N prompt tokens and samples the first output
  token (`prefill`); decode resumes from the state after N, feeding that token.
  Bit-identical to transformers' generate() in fp32 and bf16.
- "n-1" (vLLM's convention): prefill computes N-1 tokens, decode steps
  the last prompt token. Close to generate() but not bit-identical (a chunked scan over N
  tokens and a per-token step sum in different orders); disaggregated still equals colocated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from shared.cache.model_views import RankViews, torch_dtype
from shared.engine.first_feed import first_feed
from shared.engine.hf.cache_state import RECURRENT_DTYPE, HfState, build_cache, extract_ssm_layer, extract_state
from shared.engine.hf.checkpoint import HfCheckpoint, decoder_layers
from shared.engine.hf.tokenizer import HfTokenizer
from shared.engine.logprobs import TokenLogprobs
from shared.engine.paged_state import PagedStateStore
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.prompt_logprobs import score_rows
from shared.engine.protocol import EnsureCapacity, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams, sample
from shared.layout.boundary import BOUNDARIES, Boundary, num_prefill_tokens
from shared.layout.page import EngineLayout
from shared.layout.spec import ModelSpec

log = logging.getLogger(__name__)


def _check_layers(spec: ModelSpec, ckpt: HfCheckpoint) -> None:
    """Our layer kinds must be transformers' cache layers, index for index."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    cache = ckpt.new_cache()
    if len(cache.layers) != spec.num_layers:
        raise ValueError(f"{spec.name}: transformers builds {len(cache.layers)} cache layers, config.json says {spec.num_layers}")

    for i, kind in enumerate(spec.layer_kinds):
        layer = cache.layers[i]
        got = (isinstance(layer, DynamicLayer), isinstance(layer, LinearAttentionCacheLayerMixin))
        if got != (kind in ("attention", "parallel"), kind in ("ssm", "parallel")):
            raise ValueError(
                f"{spec.name}: layer {i} is {kind!r} in config.json but transformers caches it as {type(layer).__name__}"
            )


class HfEngine:
    samples = True

    def __init__(
        self,
        layout: EngineLayout,
        ranks: Sequence[RankViews],
        checkpoint: HfCheckpoint,
        *,
        boundary: Boundary = "full",
        prefill_chunk_tokens: int = 0,
    ) -> None:
        if boundary not in BOUNDARIES:
            raise ValueError(f"boundary must be one of {', '.join(BOUNDARIES)}, got {boundary!r}")
        self.spec = layout.spec
        self.layout = layout
        self.ranks = list(ranks)
        self.checkpoint = checkpoint
        self.boundary: Boundary = boundary
        # --prefill-chunk-tokens: prefill runs one forward per chunk on one cache (0: one forward);
        # chunks of this size only give these bits (ChunkedPrefill), so parts come in them.
        self.exact_chunk_tokens: int | None = prefill_chunk_tokens
        self.tokenizer = HfTokenizer(checkpoint.directory)
        # /v1/chat/completions renders with it (`template_for`); None: the byte template.
        self.chat_template = self.tokenizer.chat_template
        if self.chat_template is None:
            log.info("%s: the checkpoint has no chat template; chat completions use the byte template", checkpoint.directory)
        self.eos_token_ids = checkpoint.eos_token_ids
        if checkpoint.vocab_size != self.spec.vocab_size:
            raise ValueError(
                f"{self.spec.name}: the model has {checkpoint.vocab_size} logits, config.json vocab_size {self.spec.vocab_size}"
            )
        _check_layers(self.spec, checkpoint)
        # The dtypes transformers' cache holds: reads from blocks are cast back to them.
        self._kv_dtype = self._conv_dtype = checkpoint.dtype
        self._ssm_dtype = RECURRENT_DTYPE

    @classmethod
    def load(
        cls,
        layout: EngineLayout,
        ranks: Sequence[RankViews],
        directory: str,
        *,
        dtype: str,
        device: str = "cpu",
        boundary: Boundary = "full",
        prefill_chunk_tokens: int = 0,
    ) -> HfEngine:
        checkpoint = HfCheckpoint(directory, dtype=dtype, device=device)
        return cls(layout, ranks, checkpoint, boundary=boundary, prefill_chunk_tokens=prefill_chunk_tokens)

    def prefix_stable_unit(self, prefill_chunk_tokens: int) -> int | None:
        """Chunks of C tokens from token 0 (--prefill-chunk-tokens C): a chunk made of the same
        tokens after the same earlier chunks runs the identical forward on identical inputs, so
        its K/V are the same bits whatever follows; a shorter or different chunk may round
        them differently. One forward over the whole prompt (0): other prompt lengths change
        every matmul's shape, so no prefix is stable."""
        return prefill_chunk_tokens or None

    def num_prefill_tokens(self, prompt_len: int) -> int:
        return num_prefill_tokens(self.spec, prompt_len, self.boundary)

    def _store(self, blocks: RequestBlocks) -> PagedStateStore:
        return PagedStateStore(self.layout, self.ranks, blocks)

    # --- prefill ------------------------------------------------------------------------
    def compute_prefix(self, prompt: Sequence[int], length: int, *, chunk_tokens: int = 0) -> tuple[HfState, Tensor | None]:
        """prompt[:length] on a fresh cache, in one forward (or one per chunk of `chunk_tokens`,
        as a chunked prefill runs): its state and last logits."""
        cache = self.checkpoint.new_cache()
        if length == 0:
            return HfState(0, {}, {}), None
        logits, start = None, 0
        for end in chunk_ends(0, length, chunk_tokens):
            logits, start = self.checkpoint.forward(prompt[start:end], start, cache), end
        return extract_state(cache, self.spec, length), logits

    def prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> int | None:
        """Write the prompt's state into `blocks`; at the full-N boundary also sample and return
        the first output token (output index 0), else None."""
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        n = self.num_prefill_tokens(len(prompt))
        if self.exact_chunk_tokens:
            run = self.start_prefill(prompt, blocks, sampling)
            first = None
            for end in chunk_ends(0, n, self.exact_chunk_tokens):
                first = run.compute(end)
            return first
        store = self._store(blocks)
        store.reset_ssm()  # its blocks may still hold an earlier request's state
        state, logits = self.compute_prefix(prompt, n)
        write_state(store, state)
        if self.boundary == "full":
            assert logits is not None
            return sample(logits, sampling, 0)
        return None

    def start_prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> HfPrefillRun:
        return HfPrefillRun(self, prompt, self._store(blocks), sampling)

    # --- decode -------------------------------------------------------------------------
    def read_state(self, blocks: RequestBlocks, length: int) -> HfState:
        """The state in `blocks` after `length` tokens, in the dtypes transformers computes in."""
        return read_state(self._store(blocks), self.spec, length, (self._kv_dtype, self._conv_dtype, self._ssm_dtype))

    def start_decode(
        self,
        prompt: Sequence[int],
        num_computed: int,
        blocks: RequestBlocks,
        ensure_capacity: EnsureCapacity,
        *,
        sampling: SamplingParams = GREEDY,
        first_token: int | None = None,
    ) -> HfDecodeSession:
        return HfDecodeSession(self, prompt, num_computed, self._store(blocks), ensure_capacity, sampling, first_token)

    def check_state(
        self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, *, chunk_tokens: int | None = None
    ) -> list[str]:
        """Recompute the prefix in prefill's chunks and compare it with the state in `blocks`, at
        the blocks' precision."""
        store = self._store(blocks)
        chunk = self.exact_chunk_tokens if chunk_tokens is None else chunk_tokens
        expected, _ = self.compute_prefix(prompt, num_computed, chunk_tokens=chunk or 0)
        dtypes = (torch_dtype(self.spec.kv_dtype), torch_dtype(self.spec.conv_dtype), torch_dtype(self.spec.ssm_dtype))
        got = read_state(store, self.spec, num_computed, dtypes)
        problems = store.replica_mismatches(num_computed)
        for layer, (k, v) in expected.kv.items():
            gk, gv = got.kv[layer]
            if not (torch.equal(k.to(gk.dtype), gk) and torch.equal(v.to(gv.dtype), gv)):
                problems.append(f"layer {layer}: K/V differ from the prefill computation")
        for layer, (conv, ssm) in expected.ssm.items():
            gc, gs = got.ssm[layer]
            if not torch.equal(conv.to(gc.dtype), gc):
                problems.append(f"layer {layer}: conv state differs from the prefill computation")
            if not torch.equal(ssm.to(gs.dtype), gs):
                problems.append(f"layer {layer}: SSM state differs from the prefill computation")
        return problems


def write_state(store: PagedStateStore, state: HfState) -> None:
    for layer, (k, v) in state.kv.items():
        store.write_kv_range(layer, 0, k, v)
    for layer, (conv, ssm) in state.ssm.items():
        store.write_ssm(layer, conv, ssm)


def read_state(
    store: PagedStateStore, spec: ModelSpec, length: int, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
) -> HfState:
    """(kv, conv, ssm) dtypes: the store reads in fp32, which holds every stored value exactly."""
    kv_dtype, conv_dtype, ssm_dtype = dtypes
    if length == 0:
        return HfState(0, {}, {})
    kv = {}
    for layer in spec.attention_layers:
        k, v = store.read_kv(layer, length)
        kv[layer] = (k.to(kv_dtype), v.to(kv_dtype))
    ssm = {}
    for layer in spec.ssm_layers:
        conv, state = store.read_ssm(layer)
        ssm[layer] = (conv.to(conv_dtype), state.to(ssm_dtype))
    return HfState(length, kv, ssm)


class HfPrefillRun:
    """A prefill in chunks: one forward per chunk on one transformers cache, each chunk's K/V
    mirrored into the blocks as it is computed, the conv / SSM state with the last chunk.

    The last chunk writes layer by layer from forward hooks on the decoder layers: a layer's
    cache entry is final once its forward returns (no family touches it later in the forward),
    so its bytes are written and reported (`on_layer`) while the later layers still compute."""

    def __init__(self, engine: HfEngine, prompt: Sequence[int], store: PagedStateStore, sampling: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        self._engine, self._prompt, self._store, self._sampling = engine, list(prompt), store, sampling
        self._end = engine.num_prefill_tokens(len(prompt))
        self._cache = engine.checkpoint.new_cache()
        self._pos = 0
        self.first_logits: Tensor | None = None  # full-N: what output token 0 was drawn from
        self.prompt_logprobs: list[TokenLogprobs] = []
        self._score: int | None = None  # prompt logprobs' top count (None: none kept)

    def score_prompt(self, k: int) -> None:
        self._score = k

    def _forward(self, start: int, end: int) -> Tensor:
        """The chunk's forward: the last token's logits (with prompt logprobs, kept from every row)."""
        ids, checkpoint = self._prompt[start:end], self._engine.checkpoint
        if self._score is None:
            return checkpoint.forward(ids, start, self._cache)
        rows = checkpoint.forward_all(ids, start, self._cache)
        self.prompt_logprobs += score_rows(self._prompt, start, rows, self._score)
        return rows[-1]

    def _write_kv(self, layer: int, start: int, end: int) -> None:
        """Mirror K/V of positions [start, end) of attention layer `layer` into the blocks."""
        entry = self._cache.layers[layer]
        k = entry.keys[0, :, start:end].transpose(0, 1)
        v = entry.values[0, :, start:end].transpose(0, 1)
        self._store.write_kv_range(layer, start, k, v)

    def _write_layer(self, layer: int, start: int, end: int) -> None:
        """The last chunk: layer `layer`'s K/V of [start, end) and its conv / SSM state."""
        spec = self._engine.spec
        if layer in spec.attention_layers:
            self._write_kv(layer, start, end)
        if layer in spec.ssm_layers:
            self._store.write_ssm(layer, *extract_ssm_layer(self._cache, spec, layer))

    def compute(self, end: int, on_layer: Callable[[int], None] | None = None) -> int | None:
        start, engine, spec = self._pos, self._engine, self._engine.spec
        if not start < end <= self._end:
            raise ValueError(f"chunk [{start}, {end}) outside the {self._end} tokens prefill computes")
        if start == 0:
            self._store.reset_ssm()  # its blocks may still hold an earlier request's state
        if end < self._end:
            self._forward(start, end)
            for layer in spec.attention_layers:
                self._write_kv(layer, start, end)
            self._pos = end
            return None
        done = 0  # layers written and reported from the hooks

        def finish(layer: int) -> None:  # decoder layer `layer`'s forward returned
            nonlocal done
            if layer != done:
                raise RuntimeError(f"decoder layer {layer} ran its forward when layer {done} was due")
            self._write_layer(layer, start, end)
            if on_layer is not None:
                on_layer(layer)
            done += 1

        layers = decoder_layers(engine.checkpoint.model)
        if layers is None or len(layers) != spec.num_layers:
            layers = []
        hooks = [module.register_forward_hook(lambda *_, i=i: finish(i)) for i, module in enumerate(layers)]
        try:
            logits = self._forward(start, end)
        finally:
            for hook in hooks:
                hook.remove()
        # Layers no hook finished (no decoder layers found): written after the forward, then reported.
        rest = range(done, spec.num_layers)
        for layer in rest:
            self._write_layer(layer, start, end)
        for layer in rest:
            if on_layer is not None:
                on_layer(layer)
        self._pos = end
        if engine.boundary != "full":
            return None
        self.first_logits = logits
        return sample(logits, self._sampling, 0)


class HfDecodeSession:
    """One request's decode: a transformers cache rebuilt from the blocks, then one token a step.

    Every step grows the request's blocks through `ensure_capacity` and mirrors the new K/V into
    them; the recurrent states (fixed size) stay in the transformers cache."""

    def __init__(
        self,
        engine: HfEngine,
        prompt: Sequence[int],
        num_computed: int,
        store: PagedStateStore,
        ensure_capacity: EnsureCapacity,
        sampling: SamplingParams,
        first_token: int | None,
    ) -> None:
        self._engine = engine
        self._store = store
        self._ensure = ensure_capacity
        self._sampling = sampling
        self._pending, self._index = first_feed(prompt, num_computed, first_token)
        self._pos = num_computed
        state = engine.read_state(store.blocks, num_computed)
        self._cache = build_cache(engine.checkpoint.config, engine.spec, state)
        self.last_logits: Tensor | None = None

    @property
    def blocks(self) -> RequestBlocks:
        """The request's blocks as last grown."""
        return self._store.blocks

    @property
    def num_tokens(self) -> int:
        """Tokens whose state this session holds (prompt and generated, fed so far)."""
        return self._pos

    def state(self) -> HfState:
        """A copy of the state after `num_tokens` tokens, taken from the transformers cache."""
        return extract_state(self._cache, self._engine.spec, self._pos)

    def step(self) -> int:
        tokens, start = self._pending, self._pos
        self._store.blocks = self._ensure(start + len(tokens))
        logits = self._engine.checkpoint.forward(tokens, start, self._cache)
        for layer in self._engine.spec.attention_layers:
            entry = self._cache.layers[layer]
            k = entry.keys[0, :, start:].transpose(0, 1)
            v = entry.values[0, :, start:].transpose(0, 1)
            self._store.write_kv_range(layer, start, k, v)
        self._pos += len(tokens)
        token = sample(logits, self._sampling, self._index)
        self._index += 1
        self._pending = [token]
        self.last_logits = logits
        return token
