"""--check-state against a chunked prefill (--prefill-chunk-tokens) on the checkpoint engines:
their bits depend on the chunking, so decode recomputes the prompt in the chunks its prefill peer
ran (the handshake's prefill_chunk_tokens), not in one forward of its own.

Real services in this process (grpc.aio on port 0, NIXL READs over UCX on DRAM), tiny seeded
checkpoints. Negative control: the same state checked in other chunks (OTHER_CHUNK tokens, which
cut the SSD scan's blocks elsewhere) reports mismatches, so the chunks the check uses decide its
answer. (One forward is no control for the paged engine here: its chunks of CHUNK tokens are
whole scan blocks, and it gives them the bits of one forward.)
"""

from __future__ import annotations

import pytest

from shared.engine.hf.tiny_checkpoints import cached_checkpoint
from shared.runtime.colocated import Colocated
from tests.integration.exactness.multi_turn import random_tokens
from tests.integration.services.colocated_tokens import CHECKPOINT_ENGINES, colocated_tokens
from tests.integration.services.hf_services import generate_ids, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CHUNK = 16
OTHER_CHUNK = 12  # the tiny checkpoint's SSD scan blocks are 8 tokens: 12 cuts them elsewhere
FAMILY = "nemotron_h"


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", CHECKPOINT_ENGINES)
async def test_decode_checks_a_chunked_prefill_in_its_chunks(engine: str) -> None:
    directory = cached_checkpoint(FAMILY)
    prompt = random_tokens(31, 70)
    flags = ("--prefill-chunk-tokens", str(CHUNK))
    async with hf_pair(directory, directory, 1, 2, engine=engine, prefill_flags=flags, check_state=True) as (_, decode):
        ids, summary = await generate_ids(decode.port, prompt, 6)
    assert summary.state_verified and summary.digests_verified
    assert ids == await colocated_tokens(engine, directory, prompt, 6, prefill_chunk_tokens=CHUNK)


@pytest.mark.parametrize("engine", CHECKPOINT_ENGINES)
def test_the_check_recomputes_in_the_chunks_it_is_given(engine: str) -> None:
    prompt = random_tokens(32, 70)
    colocated = Colocated.build(engine, cached_checkpoint(FAMILY), 1, 64, prefill_chunk_tokens=CHUNK)
    try:
        blocks = colocated.allocate("r", len(prompt))
        colocated.engine.prefill(prompt, blocks)  # in chunks of CHUNK
        n = colocated.engine.num_prefill_tokens(len(prompt))
        assert colocated.engine.check_state(prompt, n, blocks) == []  # the engine's own chunks
        assert colocated.engine.check_state(prompt, n, blocks, chunk_tokens=CHUNK) == []
        assert colocated.engine.check_state(prompt, n, blocks, chunk_tokens=OTHER_CHUNK) != []  # other chunks: other bits
    finally:
        colocated.close()
