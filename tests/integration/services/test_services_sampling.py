"""Sampling and stopping through the real services (reference engine, N-1): a seeded request
gives the same tokens disaggregated and colocated (the colocated baseline server), another seed
other tokens; stop token ids end a generation and say so, not before min_tokens (masked in the
sampler, prefill and decode alike); bad values name their field."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from hybridpd_tools.bench.colocated_server import colocated_servicer
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.rpc.status import describe
from shared.runtime.engine_host import engine_factory_for
from tests.decode_stream import generated
from tests.integration.services.colocated import colocated_port

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]

MODEL = "tiny-mamba2"
PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
SEEDED = dict(temperature=1.3, top_p=0.95, top_k=50)


async def _reference_pair(start_prefill: Any, start_decode: Any) -> Any:
    factory = engine_factory_for("reference")
    prefill = await start_prefill("--model", MODEL, engine=factory)
    return await start_decode(prefill.port, "--model", MODEL, "--check-state", engine=factory)


async def test_seeded_sampling_is_the_same_disaggregated_and_colocated(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    decode = await _reference_pair(start_prefill, start_decode)
    async with colocated_port(colocated_servicer("reference", MODEL, 1, 64)) as colocated:
        runs: dict[tuple[str, int], list[int]] = {}
        for port, where in ((decode.port, "disaggregated"), (colocated, "colocated")):
            for seed in (7, 8):
                sampling = dpb.SamplingParams(seed=seed, **SEEDED)
                ids, summary = await generated(
                    channel_to(port), dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=24, sampling=sampling), timeout=30
                )
                assert len(ids) == 24 and summary.finish_reason == dpb.FINISH_REASON_LENGTH
                assert summary.seed == seed
                # n-1 boundary: the first token is decode's own step, on either server, within TTFT.
                first_step = summary.first_step_engine_duration.ToNanoseconds()
                assert 0 < first_step < summary.time_to_first_token.ToNanoseconds(), where
                runs[where, seed] = ids
        greedy, _ = await generated(
            channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=24), timeout=30
        )
    assert runs["disaggregated", 7] == runs["colocated", 7]
    assert runs["disaggregated", 8] == runs["colocated", 8]
    # Negative controls: the seed and the sampling really decide the tokens.
    assert runs["disaggregated", 7] != runs["disaggregated", 8]
    assert runs["disaggregated", 7] != greedy


async def test_unseeded_sampling_picks_a_seed_and_reports_it(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    decode = await _reference_pair(start_prefill, start_decode)
    channel = channel_to(decode.port)
    first, summary = await generated(
        channel, dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=16, sampling=dpb.SamplingParams(**SEEDED)), timeout=30
    )
    assert summary.seed != 0
    again, _ = await generated(
        channel,
        dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=16, sampling=dpb.SamplingParams(seed=summary.seed, **SEEDED)),
        timeout=30,
    )
    assert again == first  # the reported seed reproduces the request


async def test_a_stop_token_id_ends_the_generation_and_says_so(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    decode = await _reference_pair(start_prefill, start_decode)
    channel = channel_to(decode.port)
    full, summary = await generated(channel, dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=20), timeout=30)
    assert summary.finish_reason == dpb.FINISH_REASON_LENGTH
    cut = next(i for i, t in enumerate(full) if i >= 2 and t not in full[:i])  # first occurrence of a token
    ids, summary = await generated(
        channel, dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=20, stop_token_ids=[full[cut]]), timeout=30
    )
    assert ids == full[: cut + 1]  # the stop token is the last one
    assert summary.finish_reason == dpb.FINISH_REASON_STOP and summary.generated_token_count == cut + 1
    assert decode.host.allocator.num_used == 0


async def test_min_tokens_masks_the_stop_id_and_disaggregated_equals_colocated(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    decode = await _reference_pair(start_prefill, start_decode)
    async with colocated_port(colocated_servicer("reference", MODEL, 1, 64)) as colocated:
        full, _ = await generated(
            channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=20), timeout=30
        )
        stop = full[0]  # the first greedy pick: without min_tokens the generation ends at once
        ask = dict(prompt_token_ids=PROMPT, max_tokens=20, stop_token_ids=[stop])
        cut, summary = await generated(channel_to(decode.port), dpb.GenerateRequest(**ask), timeout=30)
        assert cut == [stop] and summary.finish_reason == dpb.FINISH_REASON_STOP  # negative control
        runs = {}
        for port, where in ((decode.port, "disaggregated"), (colocated, "colocated")):
            for sampling in (None, dpb.SamplingParams(seed=7, **SEEDED)):
                ids, summary = await generated(
                    channel_to(port), dpb.GenerateRequest(**ask, min_tokens=6, sampling=sampling), timeout=30
                )
                assert len(ids) >= 6 and stop not in ids[:6], (where, ids)
                if summary.finish_reason == dpb.FINISH_REASON_STOP:
                    assert ids[-1] == stop and stop not in ids[:-1]
                runs[where, sampling is None] = ids
    assert runs["disaggregated", True] == runs["colocated", True]
    assert runs["disaggregated", False] == runs["colocated", False]
    assert runs["disaggregated", True][0] != stop  # the greedy pick at index 0 was masked
    assert decode.host.allocator.num_used == 0


async def test_min_tokens_above_max_tokens_names_the_field(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    decode = await _reference_pair(start_prefill, start_decode)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generated(
            channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=4, min_tokens=5), timeout=30
        )
    failure = describe(err.value)
    assert failure.status == "INVALID_ARGUMENT" and failure.fields == ("min_tokens",), failure.message
    assert "max_tokens (4)" in failure.message
    assert decode.host.allocator.num_used == 0


async def test_stop_ids_outside_the_vocabulary_name_the_field(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    decode = await _reference_pair(start_prefill, start_decode)
    vocab = decode.host.spec.vocab_size
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generated(
            channel_to(decode.port),
            dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=4, stop_token_ids=[3, vocab]),
            timeout=30,
        )
    failure = describe(err.value)
    assert failure.status == "INVALID_ARGUMENT" and failure.fields == ("stop_token_ids",), failure.message
    assert f"< {vocab} (the vocabulary), got [{vocab}]" in failure.message
    assert decode.host.allocator.num_used == 0


async def test_stop_ids_that_mask_the_whole_vocabulary_before_min_tokens_are_refused(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    decode = await _reference_pair(start_prefill, start_decode)
    channel = channel_to(decode.port)
    vocab = decode.host.spec.vocab_size
    for sampling in (None, dpb.SamplingParams(seed=7, **SEEDED)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generated(
                channel,
                dpb.GenerateRequest(
                    prompt_token_ids=PROMPT, max_tokens=4, min_tokens=2, stop_token_ids=range(vocab), sampling=sampling
                ),
                timeout=30,
            )
        failure = describe(err.value)
        assert failure.status == "INVALID_ARGUMENT" and failure.fields == ("stop_token_ids", "min_tokens"), failure.message
        assert "whole vocabulary" in failure.message
        # Negative controls: one id left is the only one drawn before min_tokens; without min_tokens
        # the same ids are fine (the first token ends the generation).
        ids, summary = await generated(
            channel,
            dpb.GenerateRequest(
                prompt_token_ids=PROMPT, max_tokens=4, min_tokens=2, stop_token_ids=range(1, vocab), sampling=sampling
            ),
            timeout=30,
        )
        assert ids[:2] == [0, 0] and summary.generated_token_count >= 2, ids
        ids, summary = await generated(
            channel, dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=4, stop_token_ids=range(vocab)), timeout=30
        )
        assert len(ids) == 1 and summary.finish_reason == dpb.FINISH_REASON_STOP
    assert decode.host.allocator.num_used == 0


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": -0.5}, "sampling.temperature"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "sampling.top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "sampling.top_p"),
    ],
)
async def test_bad_sampling_values_name_their_field(
    start_prefill: Any, start_decode: Any, channel_to: Any, sampling: dict[str, float], field: str
) -> None:
    decode = await _reference_pair(start_prefill, start_decode)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generated(
            channel_to(decode.port),
            dpb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=4, sampling=dpb.SamplingParams(**sampling)),
            timeout=30,
        )
    failure = describe(err.value)
    assert failure.status == "INVALID_ARGUMENT" and failure.fields == (field,), failure.message
    assert decode.host.allocator.num_used == 0


async def test_an_engine_that_cannot_sample_refuses_a_temperature(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()  # the stamp engine: greedy only, as the synthetic engine
    decode = await start_decode(prefill.port)
    channel = channel_to(decode.port)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generated(
            channel,
            dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=4, sampling=dpb.SamplingParams(temperature=0.7)),
            timeout=30,
        )
    failure = describe(err.value)
    assert failure.status == "INVALID_ARGUMENT" and failure.fields == ("sampling.temperature",)
    assert "greedily" in failure.message
    assert prefill.host.engine.prefills == 0  # refused before anything was touched
    ids, _ = await generated(
        channel,
        dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=4, sampling=dpb.SamplingParams(temperature=0)),
        timeout=30,
    )
    assert len(ids) == 4  # greedy is fine
