"""What a decode session feeds first, one rule for every engine that continues from blocks."""

from __future__ import annotations

from collections.abc import Sequence


def first_feed(prompt: Sequence[int], num_computed: int, first_token: int | None) -> tuple[list[int], int]:
    """(tokens the first step feeds, output index of the token it draws): at the full-N boundary
    (every prompt token computed) the token prefill sampled, drawing index 1 next; else the prompt
    tokens prefill did not compute, drawing index 0."""
    if not 0 <= num_computed <= len(prompt) or not prompt:
        raise ValueError(f"num_computed {num_computed} is outside the prompt's {len(prompt)} tokens")
    if num_computed == len(prompt):
        if first_token is None:
            raise ValueError("first_token: at the full-N boundary decode continues from the token prefill sampled")
        return [int(first_token)], 1
    if first_token is not None:
        raise ValueError("first_token: only at the full-N boundary (prefill computed every prompt token)")
    return [int(t) for t in prompt[num_computed:]], 0
