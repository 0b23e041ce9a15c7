"""A request's state copied block to block inside decode's own cache: the blocks a copy needs
(`state_block_ids`) and the copy (`copy_blocks`, on the compute thread). State checkpoints
(decode_svc/state_checkpoints.py) and the forks of a request of several sequences
(decode_svc/forks.py) both copy this way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shared.cache.model_views import RankViews
from shared.engine.protocol import RequestBlocks
from shared.layout.page import EngineLayout


def state_block_ids(layout: EngineLayout, blocks: RequestBlocks, lead: int, computed: int) -> np.ndarray:
    """The request's blocks that hold its state beyond `lead` full attention blocks: attention
    blocks after `lead` up to the one the computed tokens end in, then every Mamba group's
    blocks (group order)."""
    end = -(-computed // layout.block_size)
    parts = [
        np.asarray(ids[lead:end] if g.kind == "attention" else ids, dtype=np.int64)
        for ids, g in zip(blocks.block_ids, layout.groups)
    ]
    return np.concatenate(parts)


def copy_blocks(views: Sequence[RankViews], src: np.ndarray, dst: np.ndarray) -> None:
    """On the compute thread: pool blocks `src` into blocks `dst`, every region of every rank."""
    for view in views:
        cache = view.cache
        s, d = torch.from_numpy(src).to(cache.device), torch.from_numpy(dst).to(cache.device)
        for region in range(cache.num_regions):
            pool = cache.blocks(region)
            pool.index_copy_(0, d, pool.index_select(0, s))
