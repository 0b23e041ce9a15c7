"""The job's sampling and its message: the parameters survive the trip, greedy travels as the
field's absence, and values the sampler refuses are refused at prefill naming the field."""

from __future__ import annotations

import pytest

from shared.engine.sampling import GREEDY, SamplingParams, with_min_tokens
from shared.errors import InvalidArgument
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.rpc.sampling_message import job_sampling_message, sampling_of_job


def job(sampling: SamplingParams) -> pb.PrefillJob:
    return pb.PrefillJob(request_id="r", prompt_token_ids=[1], sampling=job_sampling_message(sampling))


def test_sampling_survives_the_job_message() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1)
    assert sampling_of_job(job(params)) == params
    for changed in (
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=2**64 - 1),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1),
    ):
        assert sampling_of_job(job(changed)) != params  # negative control: each value travels


def test_greedy_is_the_absent_field() -> None:
    assert not job(GREEDY).HasField("sampling")
    assert sampling_of_job(pb.PrefillJob(request_id="r")) == GREEDY
    seeded_greedy = SamplingParams(seed=5)  # greedy ignores the seed, but it still travels
    assert sampling_of_job(job(seeded_greedy)) == seeded_greedy


def test_bad_values_name_the_job_field() -> None:
    msg = pb.PrefillJob(request_id="r", sampling=pb.JobSampling(temperature=1.0, top_p=0.0))
    with pytest.raises(InvalidArgument) as err:
        sampling_of_job(msg)
    assert err.value.fields == ("job.sampling.top_p",)


def test_min_tokens_and_its_masked_ids_travel() -> None:
    params = with_min_tokens(GREEDY, 3, frozenset({7, 2}))
    msg = job(params)
    assert msg.HasField("sampling")  # greedy, but not GREEDY: prefill must mask token 0
    assert list(msg.sampling.stop_token_ids) == [2, 7] and msg.sampling.min_tokens == 3
    assert sampling_of_job(msg) == params
    assert sampling_of_job(job(with_min_tokens(GREEDY, 2, frozenset({7, 2})))) != params  # negative control
