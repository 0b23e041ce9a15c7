"""A paged fp32 engine on caches of its own, with blocks laid out up front for a batch of requests:
what the engine benchmarks (paged_invariance, decode_threads, prefill_threads) start from."""

from __future__ import annotations

import numpy as np

from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.engine.hf.model_spec import hf_model_spec
from shared.engine.paged.checkpoint import PagedCheckpoint
from shared.engine.paged.engine import PagedEngine
from shared.engine.protocol import RequestBlocks
from shared.layout.page import build_engine_layout


def engine_with_blocks(directory: str, batch: int, tokens: int) -> tuple[PagedEngine, list[RequestBlocks]]:
    """The engine (TP 1, full-N boundary) and `batch` requests' blocks, each with room for `tokens`."""
    layout = build_engine_layout(hf_model_spec(directory, dtype="fp32"), 1)
    per = -(-tokens // layout.block_size)
    need = batch * sum(per if g.kind == "attention" else 1 for g in layout.groups) + 1
    ranks = [RankViews(layout, RankCache(layout.num_regions, need, layout.page_bytes, huge_pages=False))]
    engine = PagedEngine(layout, ranks, PagedCheckpoint(directory, dtype="fp32"))
    blocks, nxt = [], 1
    for b in range(batch):
        ids = []
        for g in layout.groups:
            n = per if g.kind == "attention" else 1
            ids.append(np.arange(nxt, nxt + n))
            nxt += n
        blocks.append(RequestBlocks(f"r{b}", ids))
    return engine, blocks
