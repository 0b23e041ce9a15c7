"""Colocated generation with the hf engine's model: prefill and decode in one process, on one
transformers cache, no blocks and no transfer (the baseline disaggregated runs must equal).

The boundary is the engine's: at "full" the prompt's N tokens run in one forward and the first
token is sampled from it; at "n-1" the first N-1 tokens run in one forward and the last prompt
token is stepped alone, exactly as the disaggregated pair splits the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from shared.engine.hf.checkpoint import HfCheckpoint
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.sampling import GREEDY, SamplingParams, sample, with_min_tokens

FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: FinishReason
    logits: list[Tensor] = field(default_factory=list)  # one per generated token, when kept


def finish(token: int, count: int, max_tokens: int, eos: frozenset[int], min_tokens: int = 0) -> FinishReason | None:
    """Why generation stops after `count` tokens ending in `token` (None: it goes on); an EOS
    id ends it only from min_tokens tokens on."""
    if token in eos and count >= min_tokens:
        return "stop"
    return "length" if count >= max_tokens else None


def colocated_generate(
    checkpoint: HfCheckpoint,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    boundary: str = "full",
    sampling: SamplingParams = GREEDY,
    keep_logits: bool = False,
    stop_at_eos: bool = True,
    prefill_chunk_tokens: int = 0,
    min_tokens: int = 0,
) -> Generation:
    """`prefill_chunk_tokens`: the prompt's computed tokens run one forward per chunk, as the
    services' --prefill-chunk-tokens (0: one forward). `min_tokens`: EOS ids are masked in the
    sampler before that many tokens (vLLM's min_tokens)."""
    if not prompt:
        raise ValueError("prompt: at least one token is needed")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0 <= min_tokens <= max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens {max_tokens}], got {min_tokens}")
    eos = checkpoint.eos_token_ids if stop_at_eos else frozenset()
    sampling = with_min_tokens(sampling, min_tokens, eos)
    cache = checkpoint.new_cache()

    def prefill(n: int) -> Tensor | None:
        logits, at = None, 0
        for end in chunk_ends(0, n, prefill_chunk_tokens):
            logits, at = checkpoint.forward(prompt[at:end], at, cache), end
        return logits

    if boundary == "full":
        first = prefill(len(prompt))
        assert first is not None
        logits = first
    elif boundary == "n-1":
        n = len(prompt) - 1
        prefill(n)
        logits = checkpoint.forward(prompt[n:], n, cache)
    else:
        raise ValueError(f"boundary must be 'full' or 'n-1', got {boundary!r}")
    pos = len(prompt)
    tokens: list[int] = []
    logits_kept: list[Tensor] = []
    while True:
        token = sample(logits, sampling, len(tokens))
        tokens.append(token)
        if keep_logits:
            logits_kept.append(logits.clone())
        reason = finish(token, len(tokens), max_tokens, eos, min_tokens)
        if reason is not None:
            return Generation(tokens, reason, logits_kept)
        logits = checkpoint.forward([token], pos, cache)
        pos += 1
