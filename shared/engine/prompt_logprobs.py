"""Prompt logprobs (vLLM's `prompt_logprobs`, what `echo` with `logprobs` returns): for every
prompt token but the first, its logprob under the logits of the position before it, with the k
likeliest tokens there.

Prefill computes every position they need: at the n-1 boundary it computes tokens 0..N-2,
whose logits predict tokens 1..N-1; at full-N also the last, whose logits draw the first output
token instead. A prefill run that scores (`PromptScoring`) turns each chunk's rows into logprobs
as it computes them, so no logits are kept past their chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from shared.engine.logprobs import TokenLogprobs, token_logprobs


@runtime_checkable
class PromptScoring(Protocol):
    """A prefill run that can keep its prompt's logprobs."""

    prompt_logprobs: list[TokenLogprobs]  # tokens 1.. of the prompt, as computed so far

    def score_prompt(self, k: int) -> None:
        """Keep the prompt's logprobs with the k likeliest tokens (call before any compute)."""
        ...


def score_rows(prompt: Sequence[int], start: int, rows: Tensor, k: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt tokens that rows [start, start + len(rows)) of logits predict (row
    p predicts token p + 1; a row past the prompt's end predicts an output token: skipped)."""
    out = []
    for i in range(rows.shape[0]):
        p = start + i
        if p + 1 < len(prompt):
            out.append(token_logprobs(rows[i], prompt[p + 1], k))
    return out
