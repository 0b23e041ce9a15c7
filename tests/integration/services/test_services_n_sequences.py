"""n > 1: one prompt prefilled and READ once, forked on decode into n sequences (prompt attention
blocks shared, the rest of the state copied), sequence i sampling as a request with seed + i.
Through the real services, each sequence equals a colocated request with that seed, token for
token and logprob for logprob, and the request moves the bytes of one transfer, not n."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc
import pytest

from decode_svc.request_options import sampling_from
from shared.engine.logprobs import TokenLogprobs
from shared.engine.stopping import StopRule
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.rpc.logprobs_message import logprobs_of
from shared.runtime.colocated import Colocated
from shared.runtime.engine_host import engine_factory_for
from tests.integration.services.hf_services import hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]

SEED = 2**64 - 2  # sequence i's seed wraps past 2**64: (SEED + i) mod 2**64
PROMPT = [5, 17, 33, 2, 91, 40, 7, 12, 60, 3, 21, 8, 44, 19, 70, 1, 2, 3, 4]


async def generate_n(
    port: int, n: int, **fields: object
) -> tuple[dict[int, list[int]], dict[int, list[TokenLogprobs]], dpb.GenerateSummary]:
    ids: dict[int, list[int]] = {i: [] for i in range(n)}
    lps: dict[int, list[TokenLogprobs]] = {i: [] for i in range(n)}
    summary = dpb.GenerateSummary()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = dpb.GenerateRequest(n=n, **fields)  # type: ignore[arg-type]
        async for reply in dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=60):
            if reply.HasField("chunk"):
                ids[reply.chunk.index] += reply.chunk.token_ids
                lps[reply.chunk.index] += [logprobs_of(lp) for lp in reply.chunk.logprobs]
            elif reply.HasField("summary"):
                summary = reply.summary
    return ids, lps, summary


async def colocated_seeded(
    kind: str, model: str, prompt: Sequence[int], max_tokens: int, seeds: Sequence[int], temperature: float
) -> list[tuple[list[int], list[TokenLogprobs]]]:
    """One colocated request per seed, each alone."""
    colocated = await asyncio.to_thread(Colocated.build, kind, model, 1, 512)
    out = []
    try:
        for seed in seeds:
            params = sampling_from(dpb.SamplingParams(temperature=temperature, top_k=50, seed=seed))
            stream = colocated.stream("c", prompt, max_tokens, sampling=params, stop=StopRule(max_tokens), logprobs=1)
            got = [t async for t in stream]
            out.append(([t.token_id for t in got], [t.logprobs for t in got if t.logprobs is not None]))
    finally:
        colocated.close()
    return out


async def check_n(
    port: int, kind: str, model: str, n: int, max_tokens: int, temperature: float, prompt: Sequence[int] = PROMPT
) -> dpb.GenerateSummary:
    sampling = dpb.SamplingParams(temperature=temperature, top_k=50, seed=SEED)
    fields: dict[str, object] = dict(
        prompt_token_ids=prompt, max_tokens=max_tokens, sampling=sampling, logprobs=1, ignore_eos=True
    )
    ids, lps, summary = await generate_n(port, n, **fields)
    seeds = [(SEED + i) % 2**64 for i in range(n)]
    want = await colocated_seeded(kind, model, prompt, max_tokens, seeds, temperature)
    for i in range(n):
        assert (ids[i], lps[i]) == want[i], i
    assert len({tuple(v) for v in ids.values()}) > 1  # negative control: the seeds give different sequences
    assert list(summary.generated_token_counts) == [max_tokens] * n
    assert summary.generated_token_count == n * max_tokens
    assert list(summary.finish_reasons) == [dpb.FINISH_REASON_LENGTH] * n
    return summary


@pytest.mark.parametrize("engine", ["paged", "hf"])
async def test_full_n_forks_equal_colocated_requests_with_their_seeds(hf_checkpoint: Callable[[str], str], engine: str) -> None:
    model = hf_checkpoint("qwen3_5")
    async with hf_pair(model, model, 1, 2, engine=engine) as (prefill, decode):
        block = decode.host.layout.block_size
        prompt = [(5 * i) % 150 + 4 for i in range(block + 5)]  # a full prompt block shared, the next copied
        forked = await check_n(decode.port, engine, model, 4, 6, 1.0, prompt)
        # Bytes: one transfer for n = 4 against four separate requests of the same prompt.
        single = [await generate_n(decode.port, 1, prompt_token_ids=prompt, max_tokens=6) for _ in range(4)]
        assert forked.transfer.total_bytes == single[0][2].transfer.total_bytes > 0
        assert forked.transfer.read_count == single[0][2].transfer.read_count
        separate = sum(s.transfer.total_bytes for _, _, s in single)
        print(
            f"\nbytes moved, {engine}, prompt {len(prompt)}: n=4 in one request {forked.transfer.total_bytes}, 4 requests {separate}"
        )
        async with asyncio.timeout(10):
            while decode.host.allocator.num_used or prefill.host.allocator.num_used:
                await asyncio.sleep(0.02)


async def test_n_minus_1_forks_equal_colocated_requests_with_their_seeds(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    reference = engine_factory_for("reference")
    prefill = await start_prefill("--model", "tiny-mamba2", engine=reference)
    decode = await start_decode(prefill.port, "--model", "tiny-mamba2", engine=reference)
    block = decode.host.layout.block_size
    prompt = [(7 * i) % 250 + 3 for i in range(block + 5)]  # a full prompt block shared, the next copied
    summary = await check_n(decode.port, "reference", "tiny-mamba2", 3, block, 1.0, prompt)  # the forks grow a block
    assert summary.transfer.total_bytes > 0
    async with asyncio.timeout(10):
        while decode.host.allocator.num_used or prefill.host.allocator.num_used:
            await asyncio.sleep(0.02)


async def test_n_out_of_range_is_invalid_argument(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate_n(decode.port, 17, prompt_token_ids=[1, 2], max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in (e.value.details() or "")


async def test_forks_share_the_prompt_blocks_and_copy_the_rest(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch

    from decode_svc.forks import fork_blocks, fork_key

    reference = engine_factory_for("reference")
    prefill = await start_prefill("--model", "tiny-mamba2", engine=reference)
    decode = await start_decode(prefill.port, "--model", "tiny-mamba2", engine=reference)
    host, layout = decode.host, decode.host.layout
    block = layout.block_size
    computed = 2 * block + 3  # two full attention blocks, the third partly
    local = host.allocate("r", computed + 1)
    for view in host.views:  # a recognisable state in every block of every region
        for region in range(view.cache.num_regions):
            pool = view.cache.blocks(region)
            for ids in local.block_ids:
                for b in ids:
                    pool[int(b)] = int(b) % 251
    loop = asyncio.get_running_loop()
    forks = await fork_blocks(host, "r", local, computed, computed, 3, loop.time() + 10, host.run_compute)
    try:
        for fork in forks:
            for group, mine, theirs in zip(layout.groups, local.block_ids, fork.block_ids, strict=True):
                if group.kind == "attention":
                    assert list(theirs[:2]) == list(mine[:2])  # shared, read-only
                    assert not set(theirs[2:]) & set(mine)  # the block the prompt ends in: a copy
                    copied = [(int(mine[2]), int(theirs[2]))]
                else:
                    assert not set(theirs) & set(mine)
                    copied = list(zip((int(b) for b in mine), (int(b) for b in theirs), strict=True))
                for view in host.views:
                    for region in range(view.cache.num_regions):
                        pool = view.cache.blocks(region)
                        for src, dst in copied:
                            assert torch.equal(pool[src], pool[dst])
        assert not np.array_equal(forks[0].block_ids[0], forks[1].block_ids[0])  # each fork its own
    finally:
        host.free("r")
        for i in (1, 2):
            host.free(fork_key("r", i))
    assert host.allocator.num_used == 0


async def test_forks_on_decode_local_prefill_equal_colocated(hf_checkpoint: Callable[[str], str]) -> None:
    """Decode computing the prompt itself (--local-prefill-below) draws the forks' first tokens as prefill does."""
    model = hf_checkpoint("qwen3_5")
    async with hf_pair(model, model, 1, 1, engine="paged", decode_flags=("--local-prefill-below", "1000")) as (_, decode):
        summary = await check_n(decode.port, "paged", model, 3, 5, 1.0)
    assert summary.prefilled_locally


async def test_a_cancelled_request_of_several_sequences_frees_every_block(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    reference = engine_factory_for("reference")
    prefill = await start_prefill("--model", "tiny-mamba2", engine=reference)
    decode = await start_decode(prefill.port, "--model", "tiny-mamba2", engine=reference)
    request = dpb.GenerateRequest(
        prompt_token_ids=list(range(3, 60)), max_tokens=200, n=4, sampling=dpb.SamplingParams(temperature=1.0, seed=3)
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        call = dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=60)
        seen: set[int] = set()
        async for reply in call:
            seen.add(reply.chunk.index)
            if len(seen) == 4:  # every sequence is running
                assert decode.host.allocator.num_used > 0
                call.cancel()
                break
    async with asyncio.timeout(10):
        while decode.host.allocator.num_used or prefill.host.allocator.num_used:
            await asyncio.sleep(0.02)


async def test_a_request_id_that_names_a_running_fork_is_already_exists(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    """A fork's blocks are held as `<id>#<i>`: a request of that id meanwhile would share them."""
    reference = engine_factory_for("reference")
    prefill = await start_prefill("--model", "tiny-mamba2", engine=reference)
    decode = await start_decode(prefill.port, "--model", "tiny-mamba2", engine=reference)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = dpb_grpc.DecodeServiceStub(channel)
        running = stub.Generate(dpb.GenerateRequest(request_id="x", prompt_token_ids=[1, 2, 3], max_tokens=400, n=2), timeout=60)
        await running.read()  # in flight
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate_n(decode.port, 1, request_id="x#1", prompt_token_ids=[1, 2], max_tokens=1)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        running.cancel()
    async with asyncio.timeout(10):
        while decode.host.allocator.num_used:
            await asyncio.sleep(0.02)


async def test_sequences_that_cannot_fit_the_cache_together_are_refused(start_prefill, start_decode) -> None:  # type: ignore[no-untyped-def]
    """Each alone fits, all together do not: refused at once (they would wait for each other's blocks)."""
    reference = engine_factory_for("reference")
    prefill = await start_prefill("--model", "tiny-mamba2", engine=reference)
    decode = await start_decode(prefill.port, "--model", "tiny-mamba2", "--num-blocks", "16", engine=reference)
    capacity = decode.host.max_tokens()
    fields = dict(prompt_token_ids=[1, 2, 3], max_tokens=capacity // 2)
    ids, _, _ = await generate_n(decode.port, 1, **fields)  # one fits
    assert len(ids[0]) == capacity // 2
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate_n(decode.port, 4, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n:" in (e.value.details() or "")
