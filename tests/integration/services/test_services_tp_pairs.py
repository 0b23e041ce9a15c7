"""Real bytes between real services under heterogeneous TP and block sizes (synthetic engine:
decode checks every transferred byte against what prefill must have written)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.rpc.engine_host import engine_factory_for

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


@pytest.mark.parametrize(
    ("model", "p_tp", "d_tp", "decode_flags"),
    [
        ("tiny-mamba2", 1, 2, ()),
        ("tiny-mamba2", 2, 1, ()),
        ("tiny-mamba2-g1", 2, 4, ()),
        ("tiny-gdn", 4, 2, ()),
        ("tiny-mamba1", 1, 1, ("--block-size", "64")),
    ],
)
async def test_pair_moves_every_byte(
    start_prefill: Any, start_decode: Any, channel_to: Any, model: str, p_tp: int, d_tp: int, decode_flags: tuple[str, ...]
) -> None:
    synthetic = engine_factory_for("synthetic")
    prefill = await start_prefill("--model", model, "--tp", str(p_tp), engine=synthetic)
    decode = await start_decode(
        prefill.port, "--model", model, "--tp", str(d_tp), "--check-state", *decode_flags, engine=synthetic
    )
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate([1, 2, 15, 16, 17, 40, 3, 90])]
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
