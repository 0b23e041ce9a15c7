"""Paged engines on their own caches, many requests at once, and their block bookkeeping."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.engine.paged.checkpoint import PagedCheckpoint
from shared.engine.paged.engine import PagedDecodeSession, PagedEngine
from shared.engine.protocol import RequestBlocks
from shared.layout.boundary import Boundary
from shared.layout.page import EngineLayout, build_engine_layout
from tests.unit.engine_hf.helpers import spec_of

NUM_BLOCKS = 400  # 64 requests of a few blocks each, plus room to grow


@lru_cache(maxsize=32)
def paged_checkpoint(directory: str, dtype: str = "fp32") -> PagedCheckpoint:
    return PagedCheckpoint(directory, dtype=dtype)


def paged_engine(
    directory: str,
    tp: int = 1,
    *,
    dtype: str = "fp32",
    boundary: Boundary = "full",
    invariant: bool = True,
    chunk: int = 0,
    num_blocks: int = NUM_BLOCKS,
    decode_threads: int = 1,
    prefill_threads: int = 1,
    native: bool = True,
) -> PagedEngine:
    layout = build_engine_layout(spec_of(directory, dtype), tp)
    ranks = [RankViews(layout, RankCache(layout.num_regions, num_blocks, layout.page_bytes, huge_pages=False)) for _ in range(tp)]
    return PagedEngine(
        layout,
        ranks,
        paged_checkpoint(directory, dtype),
        boundary=boundary,
        batch_invariant=invariant,
        prefill_chunk_tokens=chunk,
        decode_threads=decode_threads,
        prefill_threads=prefill_threads,
        native_kernels=native,
    )


class BlockPool:
    """Hands out block ids from 1 up (0 never used), for many requests of one engine."""

    def __init__(self, layout: EngineLayout, first: int = 1) -> None:
        self.layout = layout
        self.next = first

    def take(self, n: int) -> np.ndarray:
        ids = np.arange(self.next, self.next + n)
        self.next += n
        return ids

    def blocks(self, tokens: int, name: str = "req") -> RequestBlocks:
        n = -(-max(tokens, 1) // self.layout.block_size)
        return RequestBlocks(name, [self.take(n if g.kind == "attention" else 1) for g in self.layout.groups])

    def grower(self, holder: list[RequestBlocks]) -> Callable[[int], RequestBlocks]:
        """An ensure_capacity that grows holder[0]'s attention groups from this pool."""

        def grow(num_tokens: int) -> RequestBlocks:
            have = holder[0]
            need = -(-num_tokens // self.layout.block_size)
            ids = [
                np.concatenate([ids, self.take(need - len(ids))]) if g.kind == "attention" and need > len(ids) else ids
                for ids, g in zip(have.block_ids, self.layout.groups)
            ]
            holder[0] = RequestBlocks(have.request_id, ids)
            return holder[0]

        return grow


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(7 * i + 5 + 13 * salt) % 150 + 4 for i in range(length)]  # ids 4..153: no special token


def start(engine: PagedEngine, pool: BlockPool, prompt: list[int], name: str = "req") -> tuple[PagedDecodeSession, int | None]:
    """Prefill `prompt` into fresh blocks and start its decode on the same engine."""
    holder = [pool.blocks(len(prompt), name)]
    first = engine.prefill(prompt, holder[0])
    n = engine.num_prefill_tokens(len(prompt))
    return engine.start_decode(prompt, n, holder[0], pool.grower(holder), first_token=first), first


def logits_of(session: PagedDecodeSession) -> Tensor:
    assert session.last_logits is not None
    return session.last_logits.clone()


def set_seed() -> None:
    torch.manual_seed(0)
