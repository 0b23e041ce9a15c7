"""Seeded sampling: reproducible per (seed, output index), filters that hold, clear errors."""

from __future__ import annotations

import pytest
import torch

from shared.engine.sampling import GREEDY, SamplingParams, sample

LOGITS = torch.tensor([0.5, 2.0, 1.9, -1.0, 1.0, 0.0, 1.8, -3.0])


def test_greedy_is_argmax_in_any_dtype() -> None:
    assert sample(LOGITS, GREEDY, 0) == 1
    assert sample(LOGITS.to(torch.bfloat16), GREEDY, 7) == 1


def test_same_seed_and_index_give_the_same_token_and_seeds_differ() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    draws = [sample(LOGITS, params, i) for i in range(64)]
    assert draws == [sample(LOGITS.clone(), params, i) for i in range(64)]
    assert len(set(draws)) > 3  # it really samples
    other = [sample(LOGITS, SamplingParams(temperature=1.0, seed=43), i) for i in range(64)]
    assert other != draws


def test_top_k_and_top_p_keep_only_their_tokens() -> None:
    top3 = {1, 2, 6}
    assert {sample(LOGITS, SamplingParams(temperature=2.0, top_k=3, seed=s), 0) for s in range(200)} == top3
    assert {sample(LOGITS, SamplingParams(temperature=5.0, top_k=1, seed=s), 0) for s in range(50)} == {1}
    assert {sample(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6, seed=s), 0) for s in range(50)} == {1}
    # top_p 0.5 at temperature 1: tokens 1 and 2 hold 0.29 + 0.26 of the mass, so they suffice.
    assert {sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.5, seed=s), 0) for s in range(200)} == {1, 2}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_parameters_name_their_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
