"""Continuous batching through the real services (reference engine, real NIXL READs): requests
that run at once decode in shared steps, each token reaches the client in its own chunk as its
step ends, and every request's tokens equal the colocated run."""

from __future__ import annotations

import asyncio

import pytest

from shared.engine.reference.colocated import colocated_generate
from shared.layout.presets import TINY_PRESETS
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from tests.integration.exactness.pair import service_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

MODEL = "tiny-mamba2"


def prompt_of(i: int) -> list[int]:
    return [(11 * i + j) % 200 + 30 for j in range(4 + 5 * (i % 7))]


async def chunks_of(stub: object, prompt: list[int], max_tokens: int) -> list[list[int]]:
    call = stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens), timeout=120)  # type: ignore[attr-defined]
    return [list(r.chunk.token_ids) async for r in call if r.HasField("chunk") and r.chunk.token_ids]


async def test_concurrent_requests_share_steps_stream_one_token_a_chunk_and_equal_colocated() -> None:
    lengths = [6 + (i * 5) % 17 for i in range(12)]
    async with service_pair(MODEL, 1, 1, num_blocks=256) as pair:
        loop = pair.decode.servicer.generation.step_loop
        got = await asyncio.gather(*(chunks_of(pair.stub, prompt_of(i), n) for i, n in enumerate(lengths)))
        assert loop.running == 0
        assert loop.largest_batch > 1  # requests in flight together stepped together
        assert loop.steps < sum(lengths)  # fewer steps than tokens: steps were shared
    for i, (n, chunks) in enumerate(zip(lengths, got)):
        assert all(len(c) == 1 for c in chunks), f"request {i}: chunks {[len(c) for c in chunks]}"
        assert [c[0] for c in chunks] == colocated_generate(TINY_PRESETS[MODEL], prompt_of(i), n)
