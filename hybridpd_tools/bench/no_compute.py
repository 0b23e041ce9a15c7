"""An engine that computes nothing: prefill writes no bytes, decode steps return token 0.

For `bench control`: with it a request costs only the control plane (Session messages, block
allocation, descriptor ids, the READ of a tiny state, notification, frees), so that cost is
measured alone. The bytes a READ moves are whatever the blocks held.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.cache.regions import RankCache
from shared.engine.protocol import DecodeSession, EnsureCapacity, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams
from shared.layout import boundary
from shared.layout.boundary import Boundary
from shared.layout.page import EngineLayout


class _NoComputeSession:
    def step(self) -> int:
        return 0


class NoComputeEngine:
    eos_token_ids: frozenset[int] = frozenset()
    samples = False
    tokenizer = None  # the byte tokenizer
    boundary: Boundary = "n-1"

    def __init__(self, layout: EngineLayout, caches: Sequence[RankCache] = ()) -> None:
        self.spec = layout.spec

    def prefix_stable_unit(self, prefill_chunk_tokens: int) -> int | None:
        return None  # writes nothing

    def num_prefill_tokens(self, prompt_len: int) -> int:
        return boundary.num_prefill_tokens(self.spec, prompt_len)

    def prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: SamplingParams = GREEDY) -> None:
        return None

    def start_decode(
        self,
        prompt: Sequence[int],
        num_computed: int,
        blocks: RequestBlocks,
        ensure_capacity: EnsureCapacity,
        *,
        sampling: SamplingParams = GREEDY,
        first_token: int | None = None,
    ) -> DecodeSession:
        return _NoComputeSession()

    def check_state(
        self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, *, chunk_tokens: int | None = None
    ) -> list[str]:
        return []
