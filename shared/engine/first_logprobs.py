"""What prefill computes besides the state when a request asks: the first output token's
logprobs at the full-N boundary, where prefill draws it, and the prompt's logprobs (echo).

The engines' `prefill` returns the token only; a request that wants logprobs runs the same
prefill through `start_prefill` (the chunks `prefill` runs: the same bits) and reads the logits
the last chunk drew it from (`first_logits` of the hf and paged runs), and the prompt logprobs
the run kept (`PromptScoring`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from torch import Tensor

from shared.engine.logprobs import TokenLogprobs, token_logprobs
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.prompt_logprobs import PromptScoring
from shared.engine.protocol import ChunkedPrefill, Engine, PrefillRun, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams, sample


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


@dataclass(frozen=True)
class Prefilled:
    """What a prefill returns: the first token (full-N; else None) and the logprobs asked for."""

    first: int | None
    first_logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # tokens 1.. of the prompt
    forks: tuple[int, ...] = ()  # output token 0 drawn with each fork seed (full-N)
    fork_logprobs: tuple[TokenLogprobs, ...] = ()  # theirs, when asked


def fork_draws(
    run: PrefillRun, first: int | None, sampling: SamplingParams, seeds: Sequence[int], k: int | None
) -> tuple[tuple[int, ...], tuple[TokenLogprobs, ...]]:
    """Output token 0 drawn again from the logits `run` drew `first` from, once per seed (the
    forks of a request of several sequences), and their logprobs when asked (k)."""
    if not seeds or first is None:
        return (), ()
    if not isinstance(run, DrawingRun) or run.first_logits is None:
        raise ValueError("n: this engine's prefill keeps no logits of its first token")
    logits = run.first_logits
    tokens = tuple(sample(logits, replace(sampling, seed=seed), 0) for seed in seeds)
    if k is None:
        return tokens, ()
    return tokens, tuple(token_logprobs(logits, t, k) for t in tokens)


def start_scoring(run: PrefillRun, k: int | None) -> None:
    """Have `run` keep the prompt's logprobs with the k likeliest (k None: nothing to keep)."""
    if k is None:
        return
    if not isinstance(run, PromptScoring):
        raise ValueError("prompt_logprobs: this engine has no logits of the prompt")
    run.score_prompt(k)


def scored_prompt(run: PrefillRun, k: int | None) -> tuple[TokenLogprobs, ...] | None:
    """The prompt logprobs `run` kept (None when none were asked)."""
    if k is None:
        return None
    assert isinstance(run, PromptScoring)
    return tuple(run.prompt_logprobs)


def prefill_with_logprobs(
    engine: Engine,
    prompt: Sequence[int],
    blocks: RequestBlocks,
    sampling: SamplingParams = GREEDY,
    k: int | None = None,
    prompt_k: int | None = None,
    fork_seeds: Sequence[int] = (),
) -> Prefilled:
    """`engine.prefill(prompt, blocks, sampling)` and, when asked, the first token's logprobs
    with the k likeliest (full-N only: at n-1 decode draws it), the prompt's with `prompt_k`,
    and (full-N) the first token drawn again with each of `fork_seeds`."""
    full = engine.boundary == "full"
    wants_first = (k is not None or bool(fork_seeds)) and full
    if not wants_first and prompt_k is None:
        return Prefilled(engine.prefill(prompt, blocks, sampling))
    if not isinstance(engine, ChunkedPrefill):
        raise ValueError("logprobs: this engine cannot keep the logits of its prefill")
    run = engine.start_prefill(prompt, blocks, sampling)
    start_scoring(run, prompt_k)
    first = None
    for end in chunk_ends(0, engine.num_prefill_tokens(len(prompt)), engine.exact_chunk_tokens or 0):
        first = run.compute(end)
    return prefilled(run, first, sampling, k, prompt_k, fork_seeds)


def prefilled(
    run: PrefillRun,
    first: int | None,
    sampling: SamplingParams,
    k: int | None,
    prompt_k: int | None,
    fork_seeds: Sequence[int],
) -> Prefilled:
    """What `prefill_with_logprobs` returns, from a run whose chunks are all computed (`first`:
    what its last chunk returned; the run was started with `start_scoring(run, prompt_k)`)."""
    forks, fork_logprobs = fork_draws(run, first, sampling, fork_seeds, k)
    return Prefilled(first, run_logprobs(run, first, k), scored_prompt(run, prompt_k), forks, fork_logprobs)
