"""A batched prefill step's chunks split into groups of about equal work, one group per thread.

The split is a function of the chunks' token counts alone (never of timing, load or which thread
asks), so the same step always computes in the same groups; a chunk's bits do not depend on its
group anyway (batch invariance), the split only decides how evenly the threads are kept busy.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_groups(tokens: Sequence[int], groups: int) -> list[list[int]]:
    """The indices of `tokens` in at most `groups` non-empty groups, each in ascending order.

    Largest chunk first, each to the group with the fewest tokens so far (the lowest group on a
    tie): a step's time is its slowest group's, and this keeps that close to an even share. The
    first group holds the largest chunk."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if any(t < 1 for t in tokens):
        raise ValueError(f"tokens: every chunk has at least one token, got {list(tokens)}")
    count = min(groups, len(tokens))
    loads = [0] * count
    members: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        lightest = min(range(count), key=lambda g: (loads[g], g))
        members[lightest].append(index)
        loads[lightest] += tokens[index]
    return [sorted(group) for group in members]
