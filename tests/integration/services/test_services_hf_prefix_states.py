"""Decode's state checkpoints (--prefix-cache-states) with the hf engine at the n-1 boundary and
chunked prefill (--prefill-chunk-tokens C): the same prompt sampled with several seeds runs one
prefill job; the other requests restore the conv / SSM state and the attention blocks of the
prompt's last chunk (which the prefix cache never shares) from the checkpoint and READ nothing.

Real services in this process (grpc.aio on port 0, NIXL READs over UCX on DRAM), a tiny seeded
checkpoint. Every response equals the colocated run with the same chunks and seed bit for bit,
digests checked; the seeds give different tokens (the negative control that the sampling, not
a stored first token, decides them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from shared.engine.hf.checkpoint import HfCheckpoint
from shared.engine.hf.colocated import colocated_generate
from shared.engine.sampling import GREEDY, SamplingParams
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.integration.services.hf_services import generate_with, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

CHUNK = 40
N_MINUS_1 = ("--boundary", "n-1")
SAMPLED = dict(temperature=1.3, top_p=0.95, top_k=50)


@pytest.mark.parametrize("family,p_tp,d_tp", [("nemotron_h", 1, 1), ("bamba", 1, 2)])
async def test_hf_samples_of_one_prompt_run_one_prefill_and_equal_colocated(
    hf_checkpoint: Callable[[str], str], family: str, p_tp: int, d_tp: int
) -> None:
    directory = hf_checkpoint(family)
    prompt = [int(t) for t in np.random.default_rng(30).integers(4, 300, 100)]
    prefill_flags = ("--prefill-chunk-tokens", str(CHUNK), *N_MINUS_1)
    decode_flags = ("--prefix-cache-blocks", "64", "--prefix-cache-states", "2", "--num-blocks", "128", *N_MINUS_1)
    seeds = (0, 5, 6)
    got: list[tuple[list[int], dpb.GenerateSummary]] = []
    async with hf_pair(
        directory, directory, p_tp, d_tp, prefill_flags=prefill_flags, decode_flags=decode_flags, check_state=False
    ) as (
        _,
        decode,
    ):
        for seed in seeds:
            sampling = dpb.SamplingParams(seed=seed, **SAMPLED) if seed else None
            got.append(await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=6, sampling=sampling))
        states = decode.servicer.generation.reuse.states
        assert len(states) == 1
        lead = next(iter(states._entries.values())).lead  # TEST-ONLY: what the prefix cache supplies
    ckpt = HfCheckpoint(directory, dtype="fp32")
    for seed, (ids, summary) in zip(seeds, got, strict=True):
        sampling = SamplingParams(seed=seed, **SAMPLED) if seed else GREEDY  # type: ignore[arg-type]
        want = await asyncio.to_thread(
            colocated_generate, ckpt, prompt, 6, boundary="n-1", sampling=sampling, prefill_chunk_tokens=CHUNK
        )
        assert ids == want.token_ids, seed
        assert summary.digests_verified, seed
    first, rest = got[0][1], [s for _, s in got[1:]]
    assert not first.prefix_state_reused and first.transfer.ssm_bytes > 0
    for s in rest:
        assert s.prefix_state_reused and s.transfer.total_bytes == 0 and s.transfer.read_count == 0
        assert s.prefix_cached_tokens == len(prompt) - 1
    assert 0 < lead * decode.host.layout.block_size <= (len(prompt) - 1) // CHUNK * CHUNK  # the last chunk: the checkpoint's
    assert len({tuple(ids) for ids, _ in got}) == len(seeds)
