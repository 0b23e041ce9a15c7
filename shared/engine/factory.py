"""Pick an engine by name: `reference` (the tiny seeded model), `synthetic` (verifiable pattern),
`hf` (a Hugging Face checkpoint directory run by transformers) or `paged` (a checkpoint
directory's weights run by the project's own batched, batch-invariant math on the paged blocks)."""

from __future__ import annotations

from collections.abc import Sequence

from shared.cache.model_views import RankViews
from shared.engine.protocol import Engine
from shared.engine.reference_engine import ReferenceEngine
from shared.engine.synthetic import SyntheticEngine
from shared.layout.page import EngineLayout

ENGINE_KINDS = ("reference", "synthetic", "hf", "paged")
# Engines that run a checkpoint directory's weights (and can sample in prefill: boundary full).
CHECKPOINT_ENGINES = ("hf", "paged")


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
    batch_invariant: bool = True,
    decode_threads: int = 1,
    native_kernels: bool = True,
    prefill_threads: int = 1,
) -> Engine:
    """`ranks`: typed views of every rank's cache, in rank order. The hf engine also needs the
    checkpoint directory; it computes in `dtype` (default: the checkpoint's) on `device` (cuda:
    cuda:0). `boundary` "full" (prefill samples the first token) only the hf engine can run.
    `prefill_chunk_tokens`: the hf engine prefills in chunks of that many tokens (0: one forward).
    The paged engine takes the hf engine's arguments, plus `batch_invariant` (off: one GEMM over
    a decode step's requests, faster, bits depending on the batch), `native_kernels` (the C kernels
    where they build, mamba2_kernel.py), `decode_threads` (threads
    a decode step's tiles run on) and `prefill_threads` (threads a batched prefill step's chunks
    run on, in groups); the other engines compute on the caller's thread only."""
    if boundary != "n-1" and kind not in CHECKPOINT_ENGINES:
        raise ValueError(f"boundary {boundary!r}: the {kind} engine runs the n-1 boundary only (full needs --engine hf or paged)")
    if kind == "reference":
        if layout.spec.model_type != "reference":
            raise ValueError(
                f"the reference engine runs the tiny reference models only (tiny-*), not {layout.spec.name}; "
                "use --engine synthetic for real-model sizes"
            )
        return ReferenceEngine(layout, ranks, seed=seed)
    if kind == "synthetic":
        return SyntheticEngine(layout, ranks)
    if kind in CHECKPOINT_ENGINES:
        from shared.engine.hf.engine import HfEngine
        from shared.engine.hf.model_spec import compute_dtype
        from shared.layout.boundary import BOUNDARIES

        if model_dir is None:
            raise ValueError(f"the {kind} engine needs --model DIR, a checkpoint directory")
        if boundary not in BOUNDARIES:
            raise ValueError(f"boundary must be one of {', '.join(BOUNDARIES)}, got {boundary!r}")
        resolved = compute_dtype(model_dir, dtype)
        if kind == "paged":
            from shared.engine.paged.engine import PagedEngine

            return PagedEngine.load(
                layout,
                ranks,
                model_dir,
                dtype=resolved,
                device="cuda:0" if device == "cuda" else device,
                boundary="full" if boundary == "full" else "n-1",
                prefill_chunk_tokens=prefill_chunk_tokens,
                batch_invariant=batch_invariant,
                decode_threads=decode_threads,
                native_kernels=native_kernels,
                prefill_threads=prefill_threads,
            )
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
