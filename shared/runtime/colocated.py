"""Whole requests computed by one engine in this process: the colocated baseline.

Prefill and decode share one engine, one cache and one compute thread; decoding goes through
the same step loop as the decode service (shared/runtime/step_loop.py), so concurrent requests
decode in shared steps exactly as they do there. Blocks for prompt + max_tokens are taken up
front (`AlwaysRoom`): the baseline measures compute, not cache pressure. No NIXL, no peer.

Used by the benchmarks' colocated server, `hybrid-pd generate --colocated` for engines that run
on blocks, and the tests that compare a request under load with the same request alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.cache.allocator import BlockAllocator, BlocksExhausted
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.engine.first_logprobs import prefill_with_logprobs
from shared.engine.logprobs import TokenLogprobs
from shared.engine.protocol import Engine, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams
from shared.engine.stopping import FinishReason, StopRule
from shared.engine.timed import timed
from shared.errors import ResourceExhausted
from shared.layout.models import load_model
from shared.layout.page import EngineLayout, build_engine_layout
from shared.runtime.compute_thread import ComputeThread
from shared.runtime.step_loop import AlwaysRoom, StepLoop


@dataclass
class RunTimes:
    """Where one request's time went (seconds; `first_token_at` is time.monotonic())."""

    prefill_seconds: float = 0.0  # prefill queued and computed
    engine_seconds: float = 0.0  # prefill's engine time alone
    first_step_seconds: float = 0.0  # decode's engine time for the first token, when decode computed it
    first_token_at: float | None = None


@dataclass(frozen=True)
class Streamed:
    token_id: int
    finish: FinishReason | None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # with the first token, when asked


@dataclass
class Colocated:
    """An engine over caches of its own, serving whole requests."""

    layout: EngineLayout
    engine: Engine
    num_blocks: int
    allocator: BlockAllocator = field(init=False)
    compute: ComputeThread = field(init=False)
    step_loop: StepLoop = field(init=False)

    def __post_init__(self) -> None:
        self.allocator = BlockAllocator(self.num_blocks)
        self.compute = ComputeThread("engine")  # the services' own hop to their compute thread
        self.step_loop = StepLoop(self.engine, self.compute.submit)

    @classmethod
    def build(
        cls,
        kind: str,
        model: str,
        tp: int,
        num_blocks: int,
        *,
        kernel_block_size: int = 16,
        dtype: str | None = None,
        device: str = "cpu",
        boundary: str | None = None,
        prefill_chunk_tokens: int = 0,
        batch_invariant: bool = True,
    ) -> Colocated:
        """A fresh engine of `kind` over caches of its own: `model` is a preset name, or for the
        checkpoint engines (hf, paged) a checkpoint directory computed in `dtype` (default: the
        checkpoint's) on `device`. `boundary`: as the services' --boundary (default: full for the
        checkpoint engines, n-1 for the others)."""
        from shared.engine.factory import CHECKPOINT_ENGINES, make_engine

        checkpoint = kind in CHECKPOINT_ENGINES
        if checkpoint:
            from shared.engine.hf.model_spec import hf_model_spec

            spec = hf_model_spec(model, dtype=dtype)
        else:
            spec = load_model(model)
        layout = build_engine_layout(spec, tp, kernel_block_size=kernel_block_size)
        engine = make_engine(
            kind,
            layout,
            cls.caches(layout, num_blocks),
            model_dir=model if checkpoint else None,
            dtype=dtype,
            device=device,
            boundary=boundary or ("full" if checkpoint else "n-1"),
            prefill_chunk_tokens=prefill_chunk_tokens,
            batch_invariant=batch_invariant,
        )
        return cls(layout, engine, num_blocks)

    @staticmethod
    def caches(layout: EngineLayout, num_blocks: int) -> list[RankViews]:
        """Fresh caches for every rank of `layout` (what an engine is built over)."""
        return [RankViews(layout, RankCache(layout.num_regions, num_blocks, layout.page_bytes)) for _ in range(layout.tp)]

    def allocate(self, key: str, num_tokens: int) -> RequestBlocks:
        counts = self.layout.blocks_per_group(num_tokens)
        try:
            ids = self.allocator.allocate(key, sum(counts))
        except BlocksExhausted as e:
            raise ResourceExhausted(str(e), reason="CACHE_FULL") from e
        bounds = np.cumsum([0, *counts])
        return RequestBlocks(key, [ids[bounds[g] : bounds[g + 1]] for g in range(len(counts))])

    async def stream(
        self,
        key: str,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        sampling: SamplingParams = GREEDY,
        stop: StopRule | None = None,
        deadline: float | None = None,
        times: RunTimes | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> AsyncGenerator[Streamed, None]:
        """The request's tokens as they are computed: at the full boundary prefill's first, then
        one per decode step. `deadline`: event-loop time (None: none). `logprobs`: each token
        with its logprobs and the k likeliest (None: without); `prompt_logprobs`: the first
        token also carries the prompt's, with that many likeliest."""
        rule = stop or StopRule(max_tokens)
        times = times if times is not None else RunTimes()
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        blocks = self.allocate(key, len(prompt) + max_tokens)
        last_call: asyncio.Future[object] | None = None
        try:
            computed = self.engine.num_prefill_tokens(len(prompt))
            prefill = self.compute.submit(
                lambda: timed(prefill_with_logprobs, self.engine, prompt, blocks, sampling, logprobs, prompt_logprobs)
            )
            last_call = prefill  # type: ignore[assignment]
            done, times.engine_seconds = await asyncio.shield(prefill)
            first, scored = done.first, done.prompt_logprobs
            times.prefill_seconds = time.monotonic() - started
            generated = 0
            if first is not None:  # the full-N boundary: prefill sampled the first token
                times.first_token_at = time.monotonic()
                generated = 1
                finish = rule.finish(first, 1)
                yield Streamed(first, finish, done.first_logprobs, scored)
                if finish is not None:
                    return
            start = self.compute.submit(
                lambda: timed(
                    lambda: self.engine.start_decode(
                        prompt, computed, blocks, lambda n: blocks, sampling=sampling, first_token=first
                    )
                )
            )
            last_call = start  # type: ignore[assignment]
            decode, start_seconds = await asyncio.shield(start)
            member = self.step_loop.join(
                decode,
                rule,
                loop.time() + 1e9 if deadline is None else deadline,
                AlwaysRoom(),
                generated=generated,
                logprobs=logprobs,
            )
            try:
                async for token in member.tokens():
                    if times.first_token_at is None:
                        times.first_token_at = time.monotonic()
                        times.first_step_seconds = start_seconds + token.step_seconds  # the first token is decode's own
                    yield Streamed(token.token_id, token.finish, token.logprobs, scored if generated == 0 else None)
                    generated += 1
            finally:
                self.step_loop.leave(member)
                last_call = member.last_step
        finally:
            if last_call is not None and not last_call.done():  # the blocks are freed once no call reads them
                await asyncio.gather(last_call, return_exceptions=True)
            self.allocator.free(key)

    async def generate(
        self, key: str, prompt: Sequence[int], max_tokens: int, *, sampling: SamplingParams = GREEDY, stop: StopRule | None = None
    ) -> list[int]:
        """The request's tokens, once it finished."""
        return [t.token_id async for t in self.stream(key, prompt, max_tokens, sampling=sampling, stop=stop)]

    def close(self) -> None:
        self.compute.shutdown(wait=False)
