"""Pool blocks copied to other pool blocks of the same cache, every region of every rank (a
state checkpoint or a fork on decode, a kept chunk boundary on prefill)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shared.cache.model_views import RankViews


def copy_blocks(views: Sequence[RankViews], src: np.ndarray, dst: np.ndarray) -> None:
    """On the compute thread: pool blocks `src` into blocks `dst`, every region of every rank."""
    for view in views:
        cache = view.cache
        s, d = torch.from_numpy(src).to(cache.device), torch.from_numpy(dst).to(cache.device)
        for region in range(cache.num_regions):
            pool = cache.blocks(region)
            pool.index_copy_(0, d, pool.index_select(0, s))
