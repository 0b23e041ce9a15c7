"""min_tokens in the sampler: until output index min_tokens the stop ids cannot be drawn, by
greedy or by any seeded draw; from then on (and with min_tokens 0) they are picked as before."""

from __future__ import annotations

import pytest
import torch

from shared.engine.sampling import GREEDY, SamplingParams, masked, sample, with_min_tokens

EOS = 1
LOGITS = torch.tensor([0.5, 4.0, 1.9, -1.0, 1.0, 0.0, 1.8, -3.0])  # EOS (1) is the greedy pick


def test_greedy_skips_eos_until_min_tokens() -> None:
    params = with_min_tokens(GREEDY, 3, frozenset({EOS}))
    assert [sample(LOGITS, params, i) for i in range(5)] == [2, 2, 2, EOS, EOS]
    # Negative control: without min_tokens the same logits give EOS at once.
    assert sample(LOGITS, GREEDY, 0) == EOS
    assert with_min_tokens(GREEDY, 0, frozenset({EOS})) is GREEDY


def test_every_stop_id_is_masked() -> None:
    params = with_min_tokens(GREEDY, 1, frozenset({EOS, 2}))
    assert sample(LOGITS, params, 0) == 6
    assert sample(LOGITS.to(torch.bfloat16), params, 0) == 6  # any dtype


def test_seeded_draws_never_pick_a_masked_id_before_min_tokens() -> None:
    # Negative control: unmasked, this temperature draws EOS often.
    assert EOS in {sample(LOGITS, SamplingParams(temperature=5.0, seed=s), 0) for s in range(100)}
    for seed in range(100):
        plain = SamplingParams(temperature=5.0, seed=seed)
        params = with_min_tokens(plain, 2, frozenset({EOS}))
        assert sample(LOGITS, params, 0) != EOS and sample(LOGITS, params, 1) != EOS
        # From min_tokens on the draw is the unmasked one, bit for bit.
        assert sample(LOGITS, params, 2) == sample(LOGITS, plain, 2)


def test_mask_applies_before_top_k() -> None:
    # top_k 1 keeps the best unmasked token (2), not EOS and not an empty set.
    draws = {
        sample(LOGITS, with_min_tokens(SamplingParams(temperature=1.0, top_k=1, seed=s), 1, frozenset({EOS})), 0)
        for s in range(20)
    }
    assert draws == {2}


def test_masked_leaves_the_logits_alone_from_min_tokens_on() -> None:
    params = with_min_tokens(GREEDY, 2, frozenset({EOS, 99}))  # ids past the vocabulary are ignored
    assert masked(LOGITS, params, 2) is LOGITS
    out = masked(LOGITS, params, 1)
    assert out[EOS] == float("-inf") and torch.equal(out[2:], LOGITS[2:]) and LOGITS[EOS] == 4.0


def test_negative_min_tokens_names_the_field() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
