"""The contract between the services and a model engine.

Services own memory (paged caches, block allocation, transfers); engines own math. Prefill
writes a request's state for its first `num_computed` prompt tokens into the request's blocks
on every rank; decode continues from whatever state sits in its own blocks, whether it was
computed locally (colocated) or READ from a prefill engine (disaggregated).

Engine calls are synchronous and CPU/GPU-bound: the services run them off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from shared.engine.sampling import GREEDY, SamplingParams
from shared.engine.text import Tokenizer
from shared.layout.boundary import Boundary
from shared.layout.spec import ModelSpec


@dataclass
class RequestBlocks:
    """Logical block ids of one request, one array per KV-cache group (same ids on every rank)."""

    request_id: str
    block_ids: list[np.ndarray] = field(default_factory=list)


EnsureCapacity = Callable[[int], RequestBlocks]
"""Called by a decode session before it writes token position `n - 1`: the service grows the
request's attention-group blocks so `n` tokens fit, and returns the (possibly new) blocks."""


class DecodeSession(Protocol):
    def step(self) -> int:
        """Compute the next token from the state in the request's blocks; return its id."""
        ...


@runtime_checkable
class BatchedDecode(Protocol):
    """An engine whose decode sessions step together: one forward for many requests."""

    def step_batch(self, sessions: Sequence[DecodeSession]) -> list[int]:
        """One step of every session in `sessions` (each started by this engine's start_decode,
        each a different request) in one batched forward; returns each session's next token, in
        order. What each session computes does not depend on which other sessions share the
        step or how many (batch invariance)."""
        ...


class Engine(Protocol):
    spec: ModelSpec
    # Token ids that end a generation (a checkpoint's generation_config; none for the tiny models).
    eos_token_ids: frozenset[int]
    # Whether decode honours temperature / top_p / top_k / seed (the synthetic engine has no logits).
    samples: bool
    # Where prefill stops (shared/layout/boundary.py): "full" only where the engine samples the
    # first token in prefill (the hf engine); both engines of a pair must state the same.
    boundary: Boundary

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer for text prompts and output; None: the services' byte tokenizer."""
        ...

    def prefix_stable_unit(self, prefill_chunk_tokens: int) -> int | None:
        """The granularity of prefix stability, for K/V that a prefill engine of this kind wrote
        computing in chunks of `prefill_chunk_tokens` from token 0 (0: one forward): U means the
        K/V of a prompt's first k * U tokens is bit for bit what it writes for every prompt
        sharing those tokens and computing at least k * U (1: any prefix; None: no prefix, so
        decode's prefix cache keeps nothing of it)."""
        ...

    def num_prefill_tokens(self, prompt_len: int) -> int:
        """Tokens prefill computes: at "n-1", N - 1 for models with SSM layers (decode recomputes
        the last); at "full", N."""
        ...

    def prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> int | None:
        """Compute tokens [0, num_prefill_tokens) and write every rank's shard into `blocks`. At
        the "full" boundary also sample output token 0 with `sampling` and return it; else None."""
        ...

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
        """Continue a request whose state for `num_computed` tokens sits in `blocks`, sampling
        output token i with `sampling` at index i (greedy unless `samples`). At the "full"
        boundary `first_token` is the token prefill sampled: the first step feeds it."""
        ...

    def check_state(
        self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, *, chunk_tokens: int | None = None
    ) -> list[str]:
        """Describe every mismatch between the state in `blocks` and what prefill must have written
        (the synthetic engine compares every byte; the reference engine recomputes). Empty = exact.
        `chunk_tokens`: the chunks prefill computed the prompt in (its handshake's
        prefill_chunk_tokens, 0: one forward; None: this engine's own): an engine whose bits depend
        on the chunking (hf, paged) recomputes in the same chunks."""
        ...


class PrefillRun(Protocol):
    """One request's prefill, computed chunk by chunk (`ChunkedPrefill.start_prefill`)."""

    def compute(self, end: int, on_layer: Callable[[int], None] | None = None) -> int | None:
        """Compute the prompt's tokens from where the last call stopped (0 first) to `end`,
        writing their K/V into the blocks; the call that reaches num_prefill_tokens also writes
        the conv / SSM state and returns what `prefill` returns.

        Layer parts: in that last call only, `on_layer(layer)` is called once per model layer,
        0 .. num_layers - 1 in order, as soon as the layer's bytes in the blocks are final (K/V
        of every computed token; conv and SSM state for SSM and parallel layers; layers caching
        nothing are reported too): nothing writes them afterwards in this call. An exception
        it raises propagates out of `compute` (the run is then unusable). With or without it,
        the bits written are `prefill`'s."""
        ...


@runtime_checkable
class ChunkedPrefill(Protocol):
    """An engine that computes a prefill in chunks with the same bits as its `prefill`
    (pipelined transfer: prefill_svc/jobs.py). The reference engine's prefill is a per-token
    step loop, so any chunking gives its bits; the hf engine continues one transformers cache
    over the chunks, which rounds differently from one forward over the whole prompt, so it
    offers chunks only when its own `prefill` runs the same chunks (`prefill_chunk_tokens`):
    then disaggregated still equals colocated bit for bit at the same chunk size."""

    # None: chunks of any size give `prefill`'s bits; N: only chunks of N tokens do (the ones
    # this engine's `prefill` runs too).
    exact_chunk_tokens: int | None

    def start_prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> PrefillRun:
        """A prefill of `prompt` into `blocks`, nothing computed yet."""
        ...


@dataclass(frozen=True)
class PrefillChunk:
    """A run's next chunk in a batched prefill step: its prompt tokens up to `end`, `on_layer`
    as in `PrefillRun.compute`."""

    run: PrefillRun
    end: int
    on_layer: Callable[[int], None] | None = None


@runtime_checkable
class BatchedPrefill(Protocol):
    """An engine whose prefill runs compute their next chunks together in one forward
    (prefill's step loop: shared/runtime/prefill_loop.py)."""

    def prefill_batch(self, chunks: Sequence[PrefillChunk]) -> list[int | None]:
        """Each chunk as its run's `compute(end, on_layer)` alone would compute it, to the bit,
        and what that returns; at most one chunk per run."""
        ...


@runtime_checkable
class WarmsUp(Protocol):
    """An engine that does some work once per weight at its first use (the paged engine checks
    which GEMM calls keep a row's bits: shared/engine/paged/call_sizes.py) and can do it at load
    instead, so the first requests' steps do not wait for it."""

    # Tokens of the prompt `warm_up` computes: the caller's scratch blocks must hold one more.
    warm_up_tokens: int

    def warm_up(self, blocks: RequestBlocks) -> None:
        """A short prompt and a decode step in `blocks` (scratch: the caller frees them after)."""
        ...


@runtime_checkable
class ResumablePrefill(Protocol):
    """A chunked prefill that can start at a chunk boundary from a state kept earlier (prefill's
    boundary cache: prefill_svc/boundary_cache.py). A chunk computed from the same tokens after
    the same chunks gives the same bits, so the K/V of tokens [0, b) and the conv / SSM state
    after the chunk ending at b (a multiple of the chunk size) are all a prompt sharing those b
    tokens needs to compute on from b, with the bits of a run from token 0."""

    # False: the blocks hold the state at a narrower precision than a run carries between its
    # chunks, so continuing from them would round (no boundary is kept).
    resumes_exactly: bool

    def start_prefill_at(
        self, prompt: Sequence[int], blocks: RequestBlocks, start: int, sampling: SamplingParams = GREEDY
    ) -> PrefillRun:
        """A run of `prompt` whose tokens [0, start) are computed: their K/V and the conv / SSM
        state after them are in `blocks` already; its first chunk computes from `start`."""
        ...

    def keep_boundary_state(self, run: PrefillRun, blocks: RequestBlocks) -> None:
        """Write the conv / SSM state `run` reached (after its last computed chunk) into the
        Mamba groups' blocks of `blocks`; the run goes on unchanged."""
        ...
