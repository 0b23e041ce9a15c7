"""Real bytes between real services under heterogeneous TP and block sizes (synthetic engine:
decode checks every transferred byte against what prefill must have written)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.runtime.engine_host import engine_factory_for

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]


async def run_batch(channel: grpc.aio.Channel, prompts: list[list[int]], max_tokens: int) -> list[dpb.GenerateSummary]:
    stub = dpb_grpc.DecodeServiceStub(channel)

    async def one(prompt: list[int]) -> dpb.GenerateSummary:
        summary = None
        async for response in stub.Generate(dpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens), timeout=60):
            if response.WhichOneof("payload") == "summary":
                summary = response.summary
        assert summary is not None
        return summary

    return list(await asyncio.gather(*(one(p) for p in prompts)))


ISSUE_PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
FAMILIES = ["tiny-mamba2", "tiny-mamba2-g1", "tiny-mamba2-g2", "tiny-gdn", "tiny-mamba1"]
# Every family at every pair; (1, 1) and (2, 2) also with a decode block size different from
# prefill's, so equal TP does not mean equal block sizes.
CASES = [(m, p, d, ("--block-size", "64") if p == d else ()) for m in FAMILIES for p, d in ISSUE_PAIRS]


@pytest.mark.parametrize(("model", "p_tp", "d_tp", "decode_flags"), CASES, ids=[f"{m}-P{p}-D{d}" for m, p, d, _ in CASES])
async def test_pair_moves_every_byte(
    start_prefill: Any, start_decode: Any, channel_to: Any, model: str, p_tp: int, d_tp: int, decode_flags: tuple[str, ...]
) -> None:
    synthetic = engine_factory_for("synthetic")
    prefill = await start_prefill("--model", model, "--tp", str(p_tp), "--num-blocks", "256", engine=synthetic)
    decode = await start_decode(
        prefill.port, "--model", model, "--tp", str(d_tp), "--num-blocks", "256", "--check-state", *decode_flags, engine=synthetic
    )
    prompts = [
        [(7 * i + j) % 256 for j in range(n)] for i, n in enumerate([1, 2, 15, 16, 17, 40, 3, 90, 31, 32, 33, 47, 48, 49, 5, 64])
    ]  # 16 concurrent
    summaries = await run_batch(channel_to(decode.port), prompts, max_tokens=4)
    link = decode.peers.peers[0].link
    assert sum(link.readers_per_prefill_rank()) == len(link.pairs) == max(p_tp, d_tp)
    for prompt, summary in zip(prompts, summaries):
        assert summary.state_verified
        assert summary.num_transferred_tokens == len(prompt) - 1
        assert summary.transfer.read_count == len(link.pairs)  # ONE READ per (decode rank, source rank)
        assert summary.transfer.ssm_bytes > 0 and summary.transfer.conv_bytes > 0
        assert (summary.transfer.attention_bytes > 0) == (len(prompt) > 1)
    async with asyncio.timeout(10):
        while prefill.host.allocator.num_used:
            await asyncio.sleep(0.01)
    assert decode.host.allocator.num_used == 0
    assert prefill.pins.ended["read"] == len(prompts)


# The issue's pair always; the other directions with the slow sweeps (24 and 20 NIXL agents).
GROUP_PAIRS = [
    pytest.param(8, 16, id="P8-D16"),
    pytest.param(16, 8, id="P16-D8", marks=pytest.mark.slow),
    pytest.param(4, 16, id="P4-D16", marks=pytest.mark.slow),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("p_tp", "d_tp"), GROUP_PAIRS)
async def test_nano_at_tp16_moves_every_byte(
    start_prefill: Any, start_decode: Any, channel_to: Any, p_tp: int, d_tp: int
) -> None:
    """Nemotron-3-Nano's 8 SSM groups at TP 16 (each group on 2 ranks), real-model state sizes."""
    synthetic = engine_factory_for("synthetic")
    model = "nemotron-3-nano-30b-a3b"
    prefill = await start_prefill("--model", model, "--tp", str(p_tp), "--num-blocks", "12", engine=synthetic)
    decode = await start_decode(
        prefill.port, "--model", model, "--tp", str(d_tp), "--num-blocks", "12", "--check-state", engine=synthetic
    )
    prompts = [[(3 * i + j) % 256 for j in range(n)] for i, n in enumerate([2, 300, 700])]
    summaries = await run_batch(channel_to(decode.port), prompts, max_tokens=2)
    link = decode.peers.peers[0].link
    assert len(link.pairs) == max(p_tp, d_tp)
    for summary in summaries:
        assert summary.state_verified and summary.transfer.read_count == len(link.pairs)
    # Per SSM layer every decode rank reads x and its group's whole B and C: with TP 16 on the
    # decode side B/C move twice (one copy per replica), against the 8-rank total otherwise.
    per_layer = (256 + 2 * 128) * 3 * 2 * 16 if d_tp == 16 else (512 + 2 * 128) * 3 * 2 * 8
    assert {s.transfer.conv_bytes for s in summaries} == {per_layer * 23}


async def test_reused_id_arrays_never_carry_another_requests_ids(
    start_prefill: Any, start_decode: Any, channel_to: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decode writes each READ's descriptor ids into arrays it reuses across requests once the
    # READ was posted. Only requests of >= 65536 ids use them; with the threshold at 0 every
    # request here does, 16 at a time, and every byte must still be the right one.
    from shared.cache import id_buffers

    monkeypatch.setattr(id_buffers, "MIN_POOLED_IDS", 0)
    taken: list[int] = []
    given: list[int] = []
    take, give = id_buffers.IdBufferPool.take, id_buffers.IdBufferPool.give

    def counted_take(self: Any, count: int) -> Any:
        taken.append(count)
        return take(self, count)

    def counted_give(self: Any, arrays: Any) -> None:
        given.append(len(arrays[0]))
        give(self, arrays)

    monkeypatch.setattr(id_buffers.IdBufferPool, "take", counted_take)
    monkeypatch.setattr(id_buffers.IdBufferPool, "give", counted_give)
    synthetic = engine_factory_for("synthetic")
    prefill = await start_prefill("--model", "tiny-gdn", "--tp", "2", "--num-blocks", "256", engine=synthetic)
    decode = await start_decode(
        prefill.port, "--model", "tiny-gdn", "--tp", "1", "--num-blocks", "256", "--check-state", engine=synthetic
    )
    prompts = [[(5 * i + j) % 256 for j in range(n)] for i, n in enumerate([90, 3, 47, 64, 17, 33, 2, 80] * 2)]
    for _ in range(2):  # the second round starts with every array back in the pool
        summaries = await run_batch(channel_to(decode.port), prompts, max_tokens=2)
        assert all(s.state_verified for s in summaries)
    link = decode.peers.peers[0].link
    pool = link.id_buffers
    claims = 2 * len(prompts) * len(link.pairs)  # one per READ: 2 rounds, one READ per pair
    assert len(taken) == len(given) == claims  # every claim was given back, once
    assert 0 < pool.idle <= pool.max_idle
    assert pool.created < claims  # reused, not allocated per READ
