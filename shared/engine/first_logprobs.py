"""The first output token's logprobs at the full-N boundary, where prefill draws it.

The engines' `prefill` returns the token only; a request that wants its logprobs runs the same
prefill through `start_prefill` (the chunks `prefill` runs: the same bits) and reads the logits
the last chunk drew it from (`first_logits` of the hf and paged runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from shared.engine.logprobs import TokenLogprobs, token_logprobs
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import ChunkedPrefill, Engine, PrefillRun, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams


@runtime_checkable
class DrawingRun(Protocol):
    """A prefill run that keeps the logits it drew output token 0 from (full-N)."""

    first_logits: Tensor | None


def run_logprobs(run: PrefillRun, first: int | None, k: int | None) -> TokenLogprobs | None:
    """The logprobs of `first`, drawn by `run`'s last chunk; None when none were asked (k None)
    or nothing was drawn (the n-1 boundary)."""
    if k is None or first is None:
        return None
    if not isinstance(run, DrawingRun) or run.first_logits is None:
        raise ValueError("logprobs: this engine's prefill keeps no logits of its first token")
    return token_logprobs(run.first_logits, first, k)


def prefill_with_logprobs(
    engine: Engine, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY, k: int | None = None
) -> tuple[int | None, TokenLogprobs | None]:
    """`engine.prefill(prompt, blocks, sampling)` and, when it draws the first token and `k` is
    set, that token's logprobs with the k likeliest."""
    if k is None or engine.boundary != "full":
        return engine.prefill(prompt, blocks, sampling), None
    if not isinstance(engine, ChunkedPrefill):
        raise ValueError("logprobs: this engine cannot keep the logits of its first token")
    run = engine.start_prefill(prompt, blocks, sampling)
    first = None
    for end in chunk_ends(0, engine.num_prefill_tokens(len(prompt)), engine.exact_chunk_tokens or 0):
        first = run.compute(end)
    return first, run_logprobs(run, first, k)
