"""How a batched prefill step's chunks are split over the prefill threads (`balanced_groups`):
every chunk in exactly one group, groups in ascending order, never more groups than asked or
than chunks, about equal tokens each, and the same split for the same chunks."""

from __future__ import annotations

import pytest

from shared.engine.paged.chunk_groups import balanced_groups


def test_every_chunk_in_exactly_one_ordered_group() -> None:
    tokens = [37, 128, 5, 64, 64, 16, 128, 1, 90]
    for count in (1, 2, 3, 4, 9, 20):
        groups = balanced_groups(tokens, count)
        assert len(groups) == min(count, len(tokens))
        assert all(groups) and all(g == sorted(g) for g in groups)
        assert sorted(i for g in groups for i in g) == list(range(len(tokens)))


def test_groups_carry_about_equal_tokens() -> None:
    assert balanced_groups([128] * 8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert balanced_groups([100, 60, 50, 10], 2) == [[0, 3], [1, 2]]  # 110 tokens each
    # The largest chunk alone when it outweighs the rest: the step can be no shorter.
    assert balanced_groups([10, 500, 20, 30], 2) == [[1], [0, 2, 3]]


def test_the_split_depends_on_the_token_counts_only() -> None:
    tokens = [3, 77, 77, 12, 40]
    assert balanced_groups(tokens, 3) == balanced_groups(list(tokens), 3)
    assert balanced_groups([], 2) == []


@pytest.mark.parametrize(("tokens", "groups", "field"), [([4], 0, "groups"), ([4, 0], 2, "tokens")])
def test_bad_input_is_refused_naming_it(tokens: list[int], groups: int, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        balanced_groups(tokens, groups)
