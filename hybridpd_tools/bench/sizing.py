"""How many cache blocks a request needs, and which block ids the services hand it.

Mirrors the services on purpose (EngineHost.allocate): one allocation of
`sum(blocks_per_group)` blocks, split over the KV-cache groups in group order. With a fresh
allocator (or after every earlier request freed its blocks) that allocation is the run
starting at block 0, so a benchmark can rebuild the exact descriptor ids the services used.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from shared.layout import boundary
from shared.layout.page import EngineLayout
from shared.layout.spec import ModelSpec

IntArray = npt.NDArray[np.int64]


def prefill_tokens(spec: ModelSpec, prompt_tokens: int) -> int:
    """Tokens prefill computes and decode reads: N - 1 with SSM layers (decode recomputes the last)."""
    return boundary.num_prefill_tokens(spec, prompt_tokens)


def blocks_per_group(layout: EngineLayout, num_tokens: int) -> list[int]:
    """Logical blocks each group needs for `num_tokens` tokens (Mamba groups: always 1)."""
    return layout.blocks_per_group(num_tokens)


def blocks_needed(layout: EngineLayout, num_tokens: int) -> int:
    return sum(blocks_per_group(layout, num_tokens))


def request_blocks(layout: EngineLayout, num_tokens: int, first: int = 0) -> list[IntArray]:
    """Block ids per group of one contiguous allocation starting at `first`."""
    counts = blocks_per_group(layout, num_tokens)
    bounds = np.cumsum([first, *counts])
    return [np.arange(bounds[g], bounds[g + 1], dtype=np.int64) for g in range(len(counts))]
