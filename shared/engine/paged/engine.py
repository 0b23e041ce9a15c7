"""The `paged` engine: the checkpoint's own weights, the project's own math, state only in blocks.

Prefill computes a request's prompt (one forward, or chunks of `prefill_chunk_tokens`) and
writes every attention layer's K/V and every SSM layer's conv and SSM state into its blocks.
Decode keeps nothing per request between steps: each step reads K/V and SSM state from the
request's blocks (the bytes a transfer moves) and writes the new token's K/V and the new SSM
state back. `step_batch` steps many requests in one forward (`BatchedDecode`).

Batch invariance (`batch_invariant`, on by default): every GEMM gives each row the bits of its
own tile of `TILE_ROWS` rows (tiles.py, call_sizes.py), row-wise kernels treat every row alike,
and attention runs per request on its own K/V: a request's logits are the same bits whatever
shares its step. A step's requests are padded to whole units of rows that leave no row-wise
kernel a scalar tail: the engine's first invariant step runs on a traced stack and finds the
fewest rows this model's ops need (stack_unit.py); a few requests then compute a few rows, not a
whole stack. Off, one forward covers the unpadded requests with plain GEMMs (faster, not
invariant).

Shares of whole tiles are independent forwards (each writes only its own requests' blocks), so
with `decode_threads` N > 1 a step's tiles are split into N shares on N threads at once (torch
releases the GIL inside its ops): the calling thread and N - 1 workers, each set up as a compute
thread (one intra-op thread, compute_threads.py). A share's bits are those of the same forward on
any such thread.
A batched prefill step's chunks are independent the same way (each starts on a whole tile, its
attention and scans on its own rows, its writes to its own blocks): with `prefill_threads` N > 1
they are split into up to N groups of about equal tokens (chunk_groups.py, a function of the
chunks alone), one `Model.forward_chunks` per group, on as many such threads at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch import Tensor

from shared.cache.model_views import RankViews, torch_dtype
from shared.engine.compute_threads import compute_executor, pin_intra_op_threads
from shared.engine.first_feed import first_feed
from shared.engine.hf.engine import read_state
from shared.engine.hf.tokenizer import HfTokenizer
from shared.engine.logprobs import TokenLogprobs
from shared.engine.paged import tiles
from shared.engine.paged.attention import Attention
from shared.engine.paged.checkpoint import PagedCheckpoint
from shared.engine.paged.chunk_groups import balanced_groups
from shared.engine.paged.mamba2 import Mamba2
from shared.engine.paged.model import SSM_MIXERS, ChunkInput, ChunkOutput, Parallel, SsmStates
from shared.engine.paged.stack_unit import stack_unit, step_rows, trace_rows
from shared.engine.paged_state import PagedStateStore
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.prompt_logprobs import score_rows
from shared.engine.protocol import DecodeSession, EnsureCapacity, PrefillChunk, PrefillRun, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams, argmax_rows, draws_argmax, sample
from shared.layout.boundary import BOUNDARIES, Boundary, num_prefill_tokens
from shared.layout.page import EngineLayout

log = logging.getLogger(__name__)


def _check_layers(engine: PagedEngine) -> None:
    """The layout's layer kinds must be the model's mixers, index for index."""
    spec, layers = engine.spec, engine.checkpoint.model.layers
    if len(layers) != spec.num_layers:
        raise ValueError(f"{spec.name}: the checkpoint has {len(layers)} layers, config.json says {spec.num_layers}")
    for i, layer in enumerate(layers):
        kinds = {type(sub.mixer) for sub in layer.sublayers}
        if Parallel in kinds:
            kinds |= {Attention, Mamba2}
        got = (Attention in kinds, any(k in SSM_MIXERS for k in kinds))
        if got != (i in spec.attention_layers, i in spec.ssm_layers):
            raise ValueError(
                f"{spec.name}: layer {i} is {spec.layer_kinds[i]!r} in the layout but the model builds {sorted(k.__name__ for k in kinds)}"
            )


class PagedEngine:
    samples = True

    def __init__(
        self,
        layout: EngineLayout,
        ranks: Sequence[RankViews],
        checkpoint: PagedCheckpoint,
        *,
        boundary: Boundary = "full",
        prefill_chunk_tokens: int = 0,
        batch_invariant: bool = True,
        decode_threads: int = 1,
        prefill_threads: int = 1,
        native_kernels: bool = True,
    ) -> None:
        if boundary not in BOUNDARIES:
            raise ValueError(f"boundary must be one of {', '.join(BOUNDARIES)}, got {boundary!r}")
        if decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {decode_threads}")
        if prefill_threads < 1:
            raise ValueError(f"prefill_threads must be >= 1, got {prefill_threads}")
        self.spec = layout.spec
        self.layout = layout
        self.ranks = list(ranks)
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        self.boundary: Boundary = boundary
        self.batch_invariant = batch_invariant
        self.native_kernels = native_kernels
        self.decode_threads = decode_threads
        self._tile_workers: ThreadPoolExecutor | None = None  # made at the first step with tiles to share
        self._stack_unit: int | None = None  # found by the first invariant decode step (stack_unit.py)
        self.prefill_threads = prefill_threads
        self._group_workers: ThreadPoolExecutor | None = None  # made at the first step with groups to share
        # As the hf engine's: prefill runs these chunks itself, so only they give its bits.
        self.exact_chunk_tokens: int | None = prefill_chunk_tokens
        self.tokenizer = HfTokenizer(checkpoint.directory)
        self.chat_template = self.tokenizer.chat_template
        if self.chat_template is None:
            log.info("%s: the checkpoint has no chat template; chat completions use the byte template", checkpoint.directory)
        self.eos_token_ids = checkpoint.eos_token_ids
        if checkpoint.vocab_size != self.spec.vocab_size:
            raise ValueError(
                f"{self.spec.name}: the model has {checkpoint.vocab_size} logits, config.json vocab_size {self.spec.vocab_size}"
            )
        _check_layers(self)

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
        batch_invariant: bool = True,
        decode_threads: int = 1,
        prefill_threads: int = 1,
        native_kernels: bool = True,
    ) -> PagedEngine:
        checkpoint = PagedCheckpoint(directory, dtype=dtype, device=device)
        return cls(
            layout,
            ranks,
            checkpoint,
            boundary=boundary,
            prefill_chunk_tokens=prefill_chunk_tokens,
            batch_invariant=batch_invariant,
            decode_threads=decode_threads,
            prefill_threads=prefill_threads,
            native_kernels=native_kernels,
        )

    def prefix_stable_unit(self, prefill_chunk_tokens: int) -> int | None:
        """As the hf engine's: a chunk of the same tokens after the same chunks runs the same
        computation (its SSM scan included); one forward over the whole prompt changes the
        scan's shapes with the prompt length, so no prefix is stable."""
        return prefill_chunk_tokens or None

    def num_prefill_tokens(self, prompt_len: int) -> int:
        return num_prefill_tokens(self.spec, prompt_len, self.boundary)

    def _store(self, blocks: RequestBlocks) -> PagedStateStore:
        return PagedStateStore(self.layout, self.ranks, blocks)

    # --- prefill ------------------------------------------------------------------------
    def prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> int | None:
        """Write the prompt's state into `blocks`; at the full-N boundary also sample and return
        the first output token (output index 0), else None."""
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        n = self.num_prefill_tokens(len(prompt))
        run = self.start_prefill(prompt, blocks, sampling)
        if n == 0:
            self._store(blocks).reset_ssm()
            return None
        first = None
        for end in chunk_ends(0, n, self.exact_chunk_tokens or 0):
            first = run.compute(end)
        return first

    def start_prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> PagedPrefillRun:
        return PagedPrefillRun(self, prompt, self._store(blocks), sampling)

    # --- prefill from a kept chunk boundary (ResumablePrefill) --------------------------
    @property
    def resumes_exactly(self) -> bool:
        """Whether a run continued from the state in blocks has a run's bits: the blocks hold
        the conv state at the model's dtype and the SSM state at fp32, the precisions a run
        carries between its chunks (narrower state dtypes would round it)."""
        return (
            torch_dtype(self.spec.conv_dtype) == self.model.dtype
            and torch_dtype(self.spec.ssm_dtype) == torch.float32
            and bool(self.exact_chunk_tokens)
        )

    def start_prefill_at(
        self, prompt: Sequence[int], blocks: RequestBlocks, start: int, sampling: SamplingParams = GREEDY
    ) -> PagedPrefillRun:
        """A run whose tokens [0, start) are computed already: their K/V and the conv / SSM
        state after them sit in `blocks` (restored from a kept boundary); its first chunk reads
        that state from the blocks."""
        run = PagedPrefillRun(self, prompt, self._store(blocks), sampling)
        if not 0 <= start < run._end:
            raise ValueError(f"start {start} outside the {run._end} tokens prefill computes")
        if start:
            run._pos, run._carried = start, None
        return run

    def keep_boundary_state(self, run: PrefillRun, blocks: RequestBlocks) -> None:
        """Write `run`'s conv / SSM state after its last computed chunk into the Mamba groups'
        blocks of `blocks` (a boundary's copy; the run goes on unchanged)."""
        if not isinstance(run, PagedPrefillRun) or run.engine is not self:
            raise ValueError("keep_boundary_state: the run must come from this engine")
        store = self._store(blocks)
        if run._carried is None:  # resumed and nothing computed since: the run's blocks hold it
            source = run._store
            for layer in self.spec.ssm_layers:
                store.write_ssm(layer, *source.read_ssm(layer))
            return
        for layer, (conv, ssm) in run._carried.items():
            store.write_ssm(layer, conv, ssm)

    # --- warm-up (WarmsUp) ---------------------------------------------------------------
    # A short prompt reaches every weight a long one does; the checks are kept per weight shape
    # and alignment, so a MoE layer's experts its tokens skip share the check of one they reach
    # where their weights are aligned alike.
    warm_up_tokens = 4

    @torch.no_grad()
    def warm_up(self, blocks: RequestBlocks) -> None:
        """A prompt of `warm_up_tokens` tokens (batched prefill steps) and one decode step in
        scratch `blocks`: each invariant GEMM's call sizes are checked now (call_sizes.py), at
        load, not in the first requests' steps. No request's bits change: a check's outcome is
        fixed per weight and machine, and whoever gets the blocks next writes them anew."""
        prompt = list(range(self.warm_up_tokens))
        computed = self.num_prefill_tokens(len(prompt))
        run = self.start_prefill(prompt, blocks)
        first = None
        for end in chunk_ends(0, computed, self.exact_chunk_tokens or 0):
            (first,) = self.prefill_batch([PrefillChunk(run, end)])
        session = self.start_decode(prompt, computed, blocks, lambda _tokens: blocks, first_token=first)
        self.step_batch([session])

    @torch.no_grad()
    def prefill_batch(self, chunks: Sequence[PrefillChunk]) -> list[int | None]:
        """The next chunk of each run in one step (BatchedPrefill): one forward, or one per group
        of chunks on the prefill threads; what each returns is what its `compute` alone returns,
        to the bit, with `batch_invariant`."""
        pin_intra_op_threads(1)
        runs: list[PagedPrefillRun] = []
        for c in chunks:
            if not isinstance(c.run, PagedPrefillRun) or c.run.engine is not self:
                raise ValueError("prefill_batch: every run must come from this engine's start_prefill")
            runs.append(c.run)
        if len({id(r) for r in runs}) != len(runs):
            raise ValueError("prefill_batch: a run appears more than once (its chunks follow each other)")
        inputs = [run._input(c.end, c.on_layer) for run, c in zip(runs, chunks)]
        for run, given in zip(runs, inputs):
            if given.start == 0:
                run._store.reset_ssm()  # its blocks may still hold an earlier request's state
        outputs = self._forward_chunks(inputs)
        return [run._advance(c.end, out.logits, out.states, out.rows) for run, c, out in zip(runs, chunks, outputs)]

    def _forward_chunks(self, inputs: Sequence[ChunkInput]) -> list[ChunkOutput]:
        """`Model.forward_chunks` of `inputs`, in their order, split over the prefill threads.

        Without batch invariance a chunk's bits depend on its batch, so the step stays one forward;
        a chunk reporting layers (`on_layer`) keeps the step on the calling compute thread, where
        its reports are expected."""
        threads = self.prefill_threads
        if not self.batch_invariant or any(c.on_layer is not None for c in inputs):
            threads = 1
        groups = balanced_groups([len(c.ids) for c in inputs], threads)
        if len(groups) <= 1:
            return self.model.forward_chunks(inputs, invariant=self.batch_invariant)
        others = [self._prefill_workers().submit(self._forward_group, [inputs[i] for i in g]) for g in groups[1:]]
        try:
            mine = self._forward_group([inputs[i] for i in groups[0]])
        finally:
            wait(others)  # no worker still writes blocks once the step returns, even on an error
        by_index: dict[int, ChunkOutput] = {}
        for group, outputs in zip(groups, [mine, *(f.result() for f in others)]):
            by_index.update(zip(group, outputs))
        return [by_index[i] for i in range(len(inputs))]

    @torch.no_grad()  # grad mode is per thread: a worker's too
    def _forward_group(self, group: Sequence[ChunkInput]) -> list[ChunkOutput]:
        return self.model.forward_chunks(group, invariant=True)

    def _prefill_workers(self) -> ThreadPoolExecutor:
        if self._group_workers is None:
            self._group_workers = compute_executor("prefill-groups", workers=self.prefill_threads - 1)
        return self._group_workers

    # --- decode -------------------------------------------------------------------------
    def start_decode(
        self,
        prompt: Sequence[int],
        num_computed: int,
        blocks: RequestBlocks,
        ensure_capacity: EnsureCapacity,
        *,
        sampling: SamplingParams = GREEDY,
        first_token: int | None = None,
    ) -> PagedDecodeSession:
        return PagedDecodeSession(self, prompt, num_computed, self._store(blocks), ensure_capacity, sampling, first_token)

    @torch.no_grad()
    def step_batch(self, sessions: Sequence[DecodeSession]) -> list[int]:
        """One step of every session in one batched forward (BatchedDecode); each session's bits
        are independent of the others with `batch_invariant`. A session with more than one
        token to feed (restored after a prefix) computes them on its own."""
        pin_intra_op_threads(1)
        own: list[PagedDecodeSession] = []
        for s in sessions:
            if not isinstance(s, PagedDecodeSession) or s._engine is not self:
                raise ValueError("step_batch: every session must come from this engine's start_decode")
            own.append(s)
        if len({id(s) for s in own}) != len(own):
            raise ValueError("step_batch: a session appears more than once")
        tokens = [0] * len(own)
        singles = []
        for i, s in enumerate(own):
            if len(s._pending) > 1:
                tokens[i] = s._feed_sequence()
            else:
                singles.append(i)
        if not singles:
            return tokens
        batch = [own[i] for i in singles]
        for s in batch:
            s._store.blocks = s._ensure(s._pos + 1)
        logits = self._step_logits(batch)
        plain = [j for j, s in enumerate(batch) if draws_argmax(s._sampling, s._index)]
        drawn = dict(zip(plain, argmax_rows(logits[plain]))) if plain else {}
        for j, (i, s, row) in enumerate(zip(singles, batch, logits.unbind(0))):
            tokens[i] = s._advance(row, 1, drawn.get(j))
        return tokens

    def _step_logits(self, batch: Sequence[PagedDecodeSession]) -> Tensor:
        """The logits of each session's next token, [len(batch), vocab]."""
        ids = [s._pending[0] for s in batch]
        stores = [s._store for s in batch]
        positions = [s._pos for s in batch]
        if not self.batch_invariant:
            return self.model.forward_step(ids, stores, positions, rows=len(batch), invariant=False, native=self.native_kernels)
        if self._stack_unit is None:  # the first step: on a traced stack, which finds the unit
            rows = trace_rows(len(batch), self.model.dtype)
            logits, self._stack_unit = stack_unit(
                lambda r: self.model.forward_step(ids, stores, positions, rows=r, invariant=True, native=self.native_kernels),
                rows,
            )
            return logits
        # Thread t runs one forward over a contiguous share of whole tiles, as even a share as
        # whole tiles allow; with one thread, the whole step is one forward.
        n_tiles = -(-len(batch) // tiles.TILE_ROWS)
        threads = min(self.decode_threads, n_tiles)
        cuts = [min(len(batch), (t * n_tiles // threads) * tiles.TILE_ROWS) for t in range(threads + 1)]
        shares = [slice(cuts[t], cuts[t + 1]) for t in range(threads)]
        others = [self._workers().submit(self._share, shares[t], ids, stores, positions) for t in range(1, threads)]
        try:
            mine = self._share(shares[0], ids, stores, positions)
        finally:
            done = [f.result() for f in others]  # every share finished before the step returns
        return torch.cat([mine, *done]) if done else mine

    @torch.no_grad()  # grad mode is per thread: a worker's too
    def _share(self, share: slice, ids: Sequence[int], stores: Sequence[PagedStateStore], positions: Sequence[int]) -> Tensor:
        """The logits of the requests of `share`, computed on this thread in one forward over a
        stack of whole units (stack_unit.step_rows)."""
        assert self._stack_unit is not None
        rows = step_rows(share.stop - share.start, self._stack_unit)
        return self.model.forward_step(
            ids[share], stores[share], positions[share], rows=rows, invariant=True, native=self.native_kernels
        )

    @property
    def decode_stack_unit(self) -> int | None:
        """The rows an invariant decode step's stack is a multiple of (stack_unit.py); None until
        the first such step has found it."""
        return self._stack_unit

    def _workers(self) -> ThreadPoolExecutor:
        if self._tile_workers is None:
            self._tile_workers = compute_executor("decode-tiles", workers=self.decode_threads - 1)
        return self._tile_workers

    @torch.no_grad()
    def check_state(
        self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, *, chunk_tokens: int | None = None
    ) -> list[str]:
        """Recompute the prefix in prefill's chunks and compare it with the state in `blocks`, at
        the blocks' precision."""
        pin_intra_op_threads(1)
        store = self._store(blocks)
        expected = _CapturingStore(self.layout, self.ranks, blocks)
        carried: SsmStates = {}
        tokens_per_chunk = self.exact_chunk_tokens if chunk_tokens is None else chunk_tokens
        ends = chunk_ends(0, num_computed, tokens_per_chunk or 0)
        for begin, end in zip([0, *ends], ends):  # the chunks prefill ran
            chunk = ChunkInput(prompt[begin:end], begin, expected, carried, end == num_computed)
            carried = self._forward_chunks([chunk])[0].states
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


class _CapturingStore(PagedStateStore):
    """A store that keeps what a prefill from token 0 writes, leaving the blocks untouched."""

    def __init__(self, layout: EngineLayout, ranks: Sequence[RankViews], blocks: RequestBlocks) -> None:
        super().__init__(layout, ranks, blocks)
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.ssm: dict[int, tuple[Tensor, Tensor]] = {}

    def write_kv_range(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        if start == 0:
            self.kv[layer] = (k.clone(), v.clone())
        else:
            old_k, old_v = self.kv[layer]
            self.kv[layer] = (torch.cat([old_k[:start], k]), torch.cat([old_v[:start], v]))

    def read_kv_as(self, layer: int, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        k, v = self.kv[layer]
        return k[:length].to(dtype), v[:length].to(dtype)

    def write_ssm(self, layer: int, conv: Tensor, ssm: Tensor) -> None:
        self.ssm[layer] = (conv.clone(), ssm.clone())


class PagedPrefillRun:
    """A prefill in chunks: each chunk's K/V go to the blocks as it is computed (later chunks
    read them back from there); the conv / SSM states pass from chunk to chunk here and reach
    the blocks with the last chunk, layer by layer (`on_layer`). A chunk computes alone
    (`compute`) or beside other runs' chunks (`PagedEngine.prefill_batch`), with the same bits."""

    def __init__(self, engine: PagedEngine, prompt: Sequence[int], store: PagedStateStore, sampling: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt: at least one token is needed")
        self._engine, self._prompt, self._store, self._sampling = engine, list(prompt), store, sampling
        self._end = engine.num_prefill_tokens(len(prompt))
        self._pos = 0
        # None: the blocks hold the state to start from (a run resumed at a kept boundary).
        self._carried: SsmStates | None = {}
        self.last_logits: Tensor | None = None  # the prompt's last token's, once computed
        self.first_logits: Tensor | None = None  # full-N: what output token 0 was drawn from
        self.prompt_logprobs: list[TokenLogprobs] = []
        self._score: int | None = None  # prompt logprobs' top count (None: none kept)

    @property
    def engine(self) -> PagedEngine:
        return self._engine

    @property
    def computed(self) -> int:
        """Prompt tokens computed so far."""
        return self._pos

    def score_prompt(self, k: int) -> None:
        self._score = k

    def compute(self, end: int, on_layer: Callable[[int], None] | None = None) -> int | None:
        return self._engine.prefill_batch([PrefillChunk(self, end, on_layer)])[0]

    def _input(self, end: int, on_layer: Callable[[int], None] | None) -> ChunkInput:
        start = self._pos
        if not start < end <= self._end:
            raise ValueError(f"chunk [{start}, {end}) outside the {self._end} tokens prefill computes")
        last = end == self._end
        return ChunkInput(
            self._prompt[start:end],
            start,
            self._store,
            self._carried,
            last,
            on_layer if last else None,
            keep_rows=self._score is not None,
        )

    def _advance(self, end: int, logits: Tensor, carried: SsmStates, rows: Tensor | None) -> int | None:
        start = self._pos
        self._pos, self._carried = end, carried
        if rows is not None and self._score is not None:
            self.prompt_logprobs += score_rows(self._prompt, start, rows, self._score)
        if end == self._end:
            self.last_logits = logits
        if end == self._end and self._engine.boundary == "full":
            self.first_logits = logits
            return sample(logits, self._sampling, 0)
        return None


class PagedDecodeSession:
    """One request's decode. Holds only its position, the tokens still to feed and the sampling
    index: the state itself is in the request's blocks, read and written every step."""

    def __init__(
        self,
        engine: PagedEngine,
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
        if num_computed == 0:
            store.reset_ssm()  # nothing computed: the recurrence starts from zero
        self.last_logits: Tensor | None = None

    @property
    def blocks(self) -> RequestBlocks:
        """The request's blocks as last grown."""
        return self._store.blocks

    @property
    def num_tokens(self) -> int:
        """Tokens whose state sits in the blocks (prompt and generated, fed so far)."""
        return self._pos

    def step(self) -> int:
        """`step_batch([self])[0]`."""
        return self._engine.step_batch([self])[0]

    def _feed_sequence(self) -> int:
        """Feed the pending tokens in one forward (more than one: after a prefix restore)."""
        self._store.blocks = self._ensure(self._pos + len(self._pending))
        fed = ChunkInput(self._pending, self._pos, self._store, None, write_ssm=True)
        logits = self._engine.model.forward_chunks([fed], invariant=self._engine.batch_invariant)[0].logits
        return self._advance(logits, len(self._pending))

    def _advance(self, logits: Tensor, fed: int, drawn: int | None = None) -> int:
        """Take the token drawn from `logits` (`drawn`: already drawn, by `argmax_rows`)."""
        self._pos += fed
        token = sample(logits, self._sampling, self._index) if drawn is None else drawn
        self._index += 1
        self._pending = [token]
        self.last_logits = logits
        return token
