"""A decode step's greedy tokens in one argmax over its rows (sampling.argmax_rows) are the
tokens `sample` draws row by row: ties to the first maximum, NaN, bf16 rows; and only where
`sample` would take the argmax of the logits as they are (draws_argmax)."""

from __future__ import annotations

import math

import torch

from shared.engine.sampling import GREEDY, SamplingParams, argmax_rows, draws_argmax, sample


def test_one_argmax_equals_sample_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(40, 320)
    logits[3, [7, 9]] = 50.0  # a tie: the first index wins
    logits[5, 11] = math.nan
    logits[6] = -math.inf
    for rows in (logits, logits.to(torch.bfloat16)):
        assert argmax_rows(rows) == [sample(row, GREEDY, 4) for row in rows]
    assert argmax_rows(logits)[3] == 7


def test_only_unmasked_greedy_draws_take_the_batched_argmax() -> None:
    masked = SamplingParams(min_tokens=2, stop_token_ids=frozenset({1}))
    assert draws_argmax(GREEDY, 0)
    assert not draws_argmax(masked, 1)  # the stop id is masked at this index
    assert draws_argmax(masked, 2)
    assert not draws_argmax(SamplingParams(temperature=0.7, seed=1), 5)
