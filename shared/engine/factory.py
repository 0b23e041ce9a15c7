"""Pick an engine by name: `reference` (the tiny seeded model) or `synthetic` (verifiable pattern)."""

from __future__ import annotations

from collections.abc import Sequence

from shared.cache.model_views import RankViews
from shared.engine.protocol import Engine
from shared.engine.reference_engine import ReferenceEngine
from shared.engine.synthetic import SyntheticEngine
from shared.layout.page import EngineLayout

ENGINE_KINDS = ("reference", "synthetic")


def make_engine(kind: str, layout: EngineLayout, ranks: Sequence[RankViews], seed: int = 0) -> Engine:
    """`ranks`: typed views of every rank's cache, in rank order."""
    if kind == "reference":
        if layout.spec.model_type != "reference":
            raise ValueError(
                f"the reference engine runs the tiny reference models only (tiny-*), not {layout.spec.name}; "
                "use --engine synthetic for real-model sizes"
            )
        return ReferenceEngine(layout, ranks, seed=seed)
    if kind == "synthetic":
        return SyntheticEngine(layout, ranks)
    raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINE_KINDS)}")
