"""The first token's sampling identity (`sampling.first_draw`) and the full-N checkpoint key it
goes into (`state_checkpoints.state_key`).

`first_draw(p)` must draw output index 0 exactly as `p` does (checked on seeded random logits,
where a wrong mask or a dropped field picks another token), and two parameters that can draw a
different first token must give different identities and so different keys: each field the
sampler reads is changed alone and must change the key (the negative controls).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from decode_svc.prefix_cache import Chain
from decode_svc.state_checkpoints import state_key
from shared.engine.sampling import GREEDY, SamplingParams, first_draw, sample

CHAIN = Chain(b"root" * 4, 16)
PROMPT = [5, 9, 2, 7]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=3)


def _key(params: SamplingParams) -> bytes:
    return state_key(CHAIN, PROMPT, len(PROMPT), first_draw(params))


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        replace(GREEDY, seed=7, top_k=3, top_p=0.5),
        replace(GREEDY, min_tokens=4, stop_token_ids=frozenset({1, 2})),
        SAMPLED,
        replace(SAMPLED, min_tokens=1, stop_token_ids=frozenset({0, 11})),
        replace(SAMPLED, min_tokens=9, stop_token_ids=frozenset({0, 11})),
    ],
)
def test_the_identity_draws_the_first_token_as_the_params_do(params: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(32, generator=g) * 3
        logits[sorted(params.stop_token_ids)] += 10.0  # masked ids would win unmasked
        assert sample(logits, first_draw(params), 0) == sample(logits, params, 0)


def test_greedy_ignores_the_seed_top_p_and_top_k() -> None:
    assert first_draw(replace(GREEDY, seed=7, top_k=3, top_p=0.5)) == first_draw(GREEDY) == GREEDY
    assert _key(replace(GREEDY, seed=7, top_k=3, top_p=0.5)) == _key(GREEDY)


def test_min_tokens_past_one_and_unmasked_stop_ids_do_not_matter() -> None:
    stop = frozenset({1, 2})
    assert _key(replace(SAMPLED, min_tokens=1, stop_token_ids=stop)) == _key(replace(SAMPLED, min_tokens=5, stop_token_ids=stop))
    assert _key(replace(GREEDY, min_tokens=0, stop_token_ids=stop)) == _key(GREEDY)
    assert _key(replace(GREEDY, min_tokens=3)) == _key(GREEDY)  # nothing to mask


@pytest.mark.parametrize(
    "other",
    [
        replace(SAMPLED, temperature=1.0),
        replace(SAMPLED, top_p=0.81),
        replace(SAMPLED, top_k=21),
        replace(SAMPLED, seed=4),
        replace(SAMPLED, min_tokens=1, stop_token_ids=frozenset({1})),
        GREEDY,
    ],
)
def test_each_field_the_draw_reads_changes_the_key(other: SamplingParams) -> None:
    assert _key(other) != _key(SAMPLED)
    assert _key(other) == _key(replace(other))  # equal identities: equal keys


def test_the_masked_ids_are_part_of_the_greedy_key() -> None:
    masked = replace(GREEDY, min_tokens=1, stop_token_ids=frozenset({1}))
    assert _key(masked) != _key(GREEDY)
    assert _key(masked) != _key(replace(masked, stop_token_ids=frozenset({1, 2})))


def test_the_n_minus_1_key_names_the_tokens_alone() -> None:
    assert state_key(CHAIN, PROMPT, 3) != _key(GREEDY)
    assert state_key(CHAIN, PROMPT, 3) == state_key(CHAIN, [*PROMPT[:3], 99], 3)
    assert _key(GREEDY) != state_key(CHAIN, [*PROMPT[:3], 99], 4, first_draw(GREEDY))
