"""The prefill leg's first-token sampling at the full-N boundary: the body's values, its seed as
the decode leg reads it (negative seeds as their unsigned bits), and bad values named."""

from __future__ import annotations

import pytest

from prefill_svc.http_api import first_token_sampling
from shared.engine.sampling import GREEDY, SamplingParams
from shared.errors import InvalidArgument
from shared.http.params import SamplingParams as HttpSampling


def test_the_body_sampling_draws_the_first_token() -> None:
    assert first_token_sampling(HttpSampling()) == GREEDY
    got = first_token_sampling(HttpSampling(temperature=0.8, top_p=0.9, top_k=20, seed=-1))
    assert got == SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=2**64 - 1)
    unseeded = {first_token_sampling(HttpSampling(temperature=0.8)).seed for _ in range(4)}
    assert len(unseeded) > 1  # each leg picks its own seed when the body has none


def test_values_the_sampler_refuses_name_their_field() -> None:
    with pytest.raises(InvalidArgument) as err:
        first_token_sampling(HttpSampling(temperature=0.5, top_k=-3))
    assert err.value.fields == ("top_k",)
