"""Logprobs through the real services: disaggregated equals colocated bit for bit, the first
token's (drawn by prefill at the full-N boundary, travelling with it) included, and the prompt's
(computed by prefill; the same numbers when decode computes the prompt itself).

A paged-engine pair (the batched engine, full-N) and a reference-engine pair (n-1: every token
is decode's) on real grpc.aio servers with NIXL READs over UCX on DRAM, each against a
colocated run of the same engine kind (`Colocated`, one engine over its own caches)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc
import pytest

from shared.engine.logprobs import TokenLogprobs
from shared.engine.stopping import StopRule
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.rpc.logprobs_message import logprobs_of
from shared.runtime.colocated import Colocated
from shared.runtime.engine_host import engine_factory_for
from tests.integration.services.hf_services import hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

SEEDED = dpb.SamplingParams(temperature=0.8, top_p=0.95, top_k=30, seed=77)


async def generate_logprobs(port: int, **fields: object) -> tuple[list[int], list[TokenLogprobs]]:
    ids, logprobs, _, _ = await generate_all(port, **fields)
    return ids, logprobs


async def generate_all(
    port: int, **fields: object
) -> tuple[list[int], list[TokenLogprobs], list[TokenLogprobs] | None, dpb.GenerateSummary]:
    """Token ids, their logprobs, the prompt's logprobs (None: none came) and the summary,
    checking that the prompt's come before any token."""
    ids: list[int] = []
    logprobs: list[TokenLogprobs] = []
    prompt: list[TokenLogprobs] | None = None
    summary = dpb.GenerateSummary()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        async for reply in dpb_grpc.DecodeServiceStub(channel).Generate(dpb.GenerateRequest(**fields), timeout=60):  # type: ignore[arg-type]
            if reply.HasField("prompt_logprobs"):
                assert not ids and prompt is None
                prompt = [logprobs_of(lp) for lp in reply.prompt_logprobs.tokens]
            if reply.HasField("chunk"):
                ids.extend(reply.chunk.token_ids)
                logprobs.extend(logprobs_of(lp) for lp in reply.chunk.logprobs)
            if reply.HasField("summary"):
                summary = reply.summary
    return ids, logprobs, prompt, summary


async def colocated_logprobs(
    kind: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    k: int,
    sampling: dpb.SamplingParams | None,
    chunk: int = 0,
    prompt_k: int | None = None,
) -> tuple[list[int], list[TokenLogprobs]]:
    from decode_svc.request_options import sampling_from
    from shared.engine.sampling import GREEDY

    colocated = await asyncio.to_thread(Colocated.build, kind, model, 1, 512, prefill_chunk_tokens=chunk)
    try:
        params = GREEDY if sampling is None else sampling_from(sampling)
        stream = colocated.stream(
            "c", prompt, max_tokens, sampling=params, stop=StopRule(max_tokens), logprobs=k, prompt_logprobs=prompt_k
        )
        got = [t async for t in stream]
    finally:
        colocated.close()
    assert all(t.logprobs is not None for t in got)
    if prompt_k is not None:  # the prompt's logprobs ride with the first token: returned in their place
        assert got[0].prompt_logprobs is not None
        return [t.token_id for t in got], list(got[0].prompt_logprobs)
    return [t.token_id for t in got], [t.logprobs for t in got if t.logprobs is not None]


CASES = [
    pytest.param("paged", 0, None, id="paged-greedy"),
    pytest.param("paged", 0, SEEDED, id="paged-seeded"),
    pytest.param("hf", 0, SEEDED, id="hf-seeded"),
    # Pipelined transfer: the first token is drawn by the last chunk's span, in parts.
    pytest.param("paged", 4, SEEDED, id="paged-seeded-chunks"),
]


@pytest.mark.parametrize(("engine", "chunk", "sampling"), CASES)
async def test_full_n_pair_logprobs_equal_colocated_bit_for_bit(
    hf_checkpoint: Callable[[str], str], engine: str, chunk: int, sampling: dpb.SamplingParams | None
) -> None:
    model = hf_checkpoint("qwen3_5")
    prompt, max_tokens, k = [5, 17, 33, 2, 91, 40, 7, 12, 60, 3, 21], 6, 4
    fields: dict[str, object] = dict(prompt_token_ids=prompt, max_tokens=max_tokens, logprobs=k, ignore_eos=True)
    if sampling is not None:
        fields["sampling"] = sampling
    flags = ("--prefill-chunk-tokens", str(chunk)) if chunk else ()
    # Chunks round as chunks do; decode's --check-state recomputes in one forward, so it is off there.
    async with hf_pair(model, model, 1, 2, engine=engine, prefill_flags=flags, check_state=not chunk) as (_, decode):
        ids, got = await generate_logprobs(decode.port, **fields)
    want_ids, want = await colocated_logprobs(engine, model, prompt, max_tokens, k, sampling, chunk)
    assert ids == want_ids
    assert len(got) == max_tokens  # the first token's came from prefill, with the token
    assert got == want  # every float bit for bit (fp32 on the wire, compared as the same doubles)
    for lp in got:
        assert len(lp.top) == k
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob <= lp.top[0][1]
    # Negative control: the comparison sees a change in the last prompt token.
    _, other = await colocated_logprobs(engine, model, [*prompt[:-1], 8], max_tokens, k, sampling, chunk)
    assert other[0] != got[0]


async def test_reference_pair_logprobs_equal_colocated(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    reference = engine_factory_for("reference")
    prefill = await start_prefill("--model", "tiny-mamba2", engine=reference)
    decode = await start_decode(prefill.port, "--model", "tiny-mamba2", engine=reference)
    prompt, max_tokens = list(b"logprobs, please"), 5
    ids, got = await generate_logprobs(decode.port, prompt_token_ids=prompt, max_tokens=max_tokens, logprobs=3)
    want_ids, want = await colocated_logprobs("reference", "tiny-mamba2", prompt, max_tokens, 3, None)
    assert ids == want_ids
    assert got == want
    # Without the option: no logprobs on the wire.
    _, none = await generate_logprobs(decode.port, prompt_token_ids=prompt, max_tokens=max_tokens)
    assert none == []


async def test_logprobs_out_of_range_is_invalid_argument(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate_logprobs(decode.port, prompt_token_ids=[1, 2], max_tokens=2, logprobs=21)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs" in (e.value.details() or "")


@pytest.mark.parametrize(("engine", "chunk"), [("paged", 0), ("paged", 4), ("hf", 0)])
async def test_prompt_logprobs_from_prefill_equal_colocated_and_local_prefill(
    hf_checkpoint: Callable[[str], str], engine: str, chunk: int
) -> None:
    model = hf_checkpoint("qwen3_5")
    prompt, max_tokens, k = [5, 17, 33, 2, 91, 40, 7, 12, 60, 3, 21], 3, 2
    fields: dict[str, object] = dict(prompt_token_ids=prompt, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k)
    flags = ("--prefill-chunk-tokens", str(chunk)) if chunk else ()
    async with hf_pair(model, model, 1, 2, engine=engine, prefill_flags=flags, check_state=not chunk) as (_, decode):
        ids, got, prompt_lps, summary = await generate_all(decode.port, **fields)
    assert not summary.prefilled_locally and summary.transfer.total_bytes > 0
    want_ids, want_prompt = await colocated_logprobs(engine, model, prompt, max_tokens, k, None, chunk, prompt_k=k)
    assert ids == want_ids
    assert prompt_lps is not None and len(prompt_lps) == len(prompt) - 1
    assert [lp.token_id for lp in prompt_lps] == prompt[1:]
    assert prompt_lps == want_prompt  # bit for bit
    if not chunk:  # decode computes prompts in one forward: the same numbers when it computes this one itself
        local = ("--local-prefill-below", "1000")
        async with hf_pair(model, model, 1, 1, engine=engine, decode_flags=local) as (_, here):
            local_ids, local_got, local_prompt, local_summary = await generate_all(here.port, **fields)
        assert local_summary.prefilled_locally
        assert (local_ids, local_got, local_prompt) == (ids, got, prompt_lps)
    # Negative control: another token in the middle of the prompt changes the numbers after it.
    _, other = await colocated_logprobs(engine, model, [*prompt[:4], 99, *prompt[5:]], max_tokens, k, None, chunk, prompt_k=k)
    assert other[:3] == prompt_lps[:3] and other[5:] != prompt_lps[5:]


async def test_reference_prompt_logprobs_are_the_model_log_softmax(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    """n-1: prefill computes tokens 0..N-2, whose logits score tokens 1..N-1; checked against the
    reference model's own step logits."""
    import torch

    from shared.engine.reference.colocated import DEFAULT_SEED, cached_model
    from shared.layout.models import load_model

    reference = engine_factory_for("reference")
    prefill = await start_prefill("--model", "tiny-mamba2", engine=reference)
    decode = await start_decode(prefill.port, "--model", "tiny-mamba2", engine=reference)
    prompt = list(b"score me")
    _, _, got, _ = await generate_all(decode.port, prompt_token_ids=prompt, max_tokens=1, prompt_logprobs=0)
    model = cached_model(load_model("tiny-mamba2"), DEFAULT_SEED, "cpu")
    store = model.new_store()
    want = []
    for pos, token in enumerate(prompt[:-1]):
        logp = torch.log_softmax(model.step(token, pos, store).float(), dim=-1)
        want.append(float(logp[prompt[pos + 1]]))
    assert got is not None and [lp.logprob for lp in got] == want
    assert all(lp.top == () for lp in got)


async def test_prompt_logprobs_are_refused_where_no_prefill_can_give_them(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)  # the stamp engine: no logits
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate_all(decode.port, prompt_token_ids=[1, 2], max_tokens=2, prompt_logprobs=1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in (e.value.details() or "")
