"""A request's state copied block to block inside decode's own cache: the blocks a copy needs
(`state_block_ids`) and the copy (`copy_blocks`, on the compute thread: shared/cache/block_copy.py). State checkpoints
(decode_svc/state_checkpoints.py) and the forks of a request of several sequences
(decode_svc/forks.py) both copy this way."""

from __future__ import annotations

import numpy as np

from shared.cache.block_copy import copy_blocks
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


__all__ = ["copy_blocks", "state_block_ids"]
