"""Pick an engine by name: `reference` (the tiny seeded model), `synthetic` (verifiable pattern)
or `hf` (a Hugging Face checkpoint directory run by transformers)."""

from __future__ import annotations

from collections.abc import Sequence

from shared.cache.model_views import RankViews
from shared.engine.protocol import Engine
from shared.engine.reference_engine import ReferenceEngine
from shared.engine.synthetic import SyntheticEngine
from shared.layout.page import EngineLayout

ENGINE_KINDS = ("reference", "synthetic", "hf")


def make_engine(
    kind: str,
    layout: EngineLayout,
    ranks: Sequence[RankViews],
    seed: int = 0,
    *,
    model_dir: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    boundary: str = "n-1",
    prefill_chunk_tokens: int = 0,
) -> Engine:
    """`ranks`: typed views of every rank's cache, in rank order. The hf engine also needs the
    checkpoint directory; it computes in `dtype` (default: the checkpoint's) on `device` (cuda:
    cuda:0). `boundary` "full" (prefill samples the first token) only the hf engine can run.
    `prefill_chunk_tokens`: the hf engine prefills in chunks of that many tokens (0: one forward)."""
    if boundary != "n-1" and kind != "hf":
        raise ValueError(f"boundary {boundary!r}: the {kind} engine runs the n-1 boundary only (full needs --engine hf)")
    if kind == "reference":
        if layout.spec.model_type != "reference":
            raise ValueError(
                f"the reference engine runs the tiny reference models only (tiny-*), not {layout.spec.name}; "
                "use --engine synthetic for real-model sizes"
            )
        return ReferenceEngine(layout, ranks, seed=seed)
    if kind == "synthetic":
        return SyntheticEngine(layout, ranks)
    if kind == "hf":
        from shared.engine.hf.engine import HfEngine
        from shared.engine.hf.model_spec import compute_dtype
        from shared.layout.boundary import BOUNDARIES

        if model_dir is None:
            raise ValueError("the hf engine needs --model DIR, a checkpoint directory")
        if boundary not in BOUNDARIES:
            raise ValueError(f"boundary must be one of {', '.join(BOUNDARIES)}, got {boundary!r}")
        resolved = compute_dtype(model_dir, dtype)
        return HfEngine.load(
            layout,
            ranks,
            model_dir,
            dtype=resolved,
            device="cuda:0" if device == "cuda" else device,
            boundary="full" if boundary == "full" else "n-1",
            prefill_chunk_tokens=prefill_chunk_tokens,
        )
    raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINE_KINDS)}")
