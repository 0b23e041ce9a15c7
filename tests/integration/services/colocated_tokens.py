"""The colocated run a checkpoint engine's disaggregated tokens must equal: hf through
transformers' generate path (the oracle), paged through the colocated runner (one engine, the
decode service's step loop), each with the same boundary and prefill chunks as the pair."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from shared.engine.hf.checkpoint import HfCheckpoint
from shared.engine.hf.colocated import colocated_generate
from shared.engine.stopping import StopRule
from shared.runtime.colocated import Colocated

CHECKPOINT_ENGINES = ("hf", "paged")


async def colocated_tokens(
    engine: str,
    directory: str,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    prefill_chunk_tokens: int = 0,
    boundary: str = "full",
    stop_at_eos: bool = True,
) -> list[int]:
    """Off the event loop where it computes, so services in this process keep their heartbeats."""
    if engine == "hf":
        ckpt = await asyncio.to_thread(HfCheckpoint, directory, dtype="fp32")
        run = await asyncio.to_thread(
            colocated_generate,
            ckpt,
            prompt,
            max_tokens,
            boundary=boundary,
            prefill_chunk_tokens=prefill_chunk_tokens,
            stop_at_eos=stop_at_eos,
        )
        return run.token_ids
    if engine != "paged":
        raise ValueError(f"no colocated run for engine {engine!r}")
    colocated = await asyncio.to_thread(
        Colocated.build, "paged", directory, 1, 512, boundary=boundary, prefill_chunk_tokens=prefill_chunk_tokens
    )
    try:
        eos = colocated.engine.eos_token_ids if stop_at_eos else frozenset()
        return await colocated.generate("colocated", prompt, max_tokens, stop=StopRule.of(max_tokens, eos))
    finally:
        colocated.close()
