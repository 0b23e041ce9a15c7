"""Colocated generation: prefill and decode in one process, no transfer (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from shared.engine.reference.model import ReferenceModel
from shared.layout.spec import ModelSpec

DEFAULT_SEED = 0


@lru_cache(maxsize=16)
def cached_model(spec: ModelSpec, seed: int = DEFAULT_SEED, device: str = "cpu") -> ReferenceModel:
    """One model per (spec, seed, device) per process: weights are built once."""
    return ReferenceModel(spec, seed=seed, device=device)


def colocated_generate(
    spec: ModelSpec, prompt_ids: Sequence[int], max_tokens: int, seed: int = DEFAULT_SEED, device: str = "cpu"
) -> list[int]:
    """Greedy tokens of the plain one-process run."""
    return cached_model(spec, seed, device).generate(list(prompt_ids), max_tokens)
