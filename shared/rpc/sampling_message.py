"""`shared.engine.sampling.SamplingParams` <-> the `hybridpd.v1.JobSampling` a PrefillJob carries.

Decode resolves a request's sampling once (the seed chosen when the client gave none) and sends
it with the job, so prefill can draw the first output token at the full-N boundary exactly as a
colocated run would (min_tokens with the ids it masks included). Prefill refuses values the
sampler would refuse, naming the field.
"""

from __future__ import annotations

from shared.engine.sampling import GREEDY, SamplingError, SamplingParams
from shared.errors import InvalidArgument
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb


def job_sampling_message(params: SamplingParams) -> pb.JobSampling | None:
    """The message for `params`; None for greedy (the field's absence means greedy)."""
    if params == GREEDY:
        return None
    return pb.JobSampling(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        min_tokens=params.min_tokens,
        stop_token_ids=sorted(params.stop_token_ids),
    )


def sampling_of_job(job: pb.PrefillJob) -> SamplingParams:
    if not job.HasField("sampling"):
        return GREEDY
    s = job.sampling
    try:
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            min_tokens=s.min_tokens,
            stop_token_ids=frozenset(s.stop_token_ids),
        )
    except SamplingError as e:
        raise InvalidArgument(e.detail, field=f"job.sampling.{e.field}") from None
