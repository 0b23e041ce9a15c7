"""FAKE engine for the service tests (a stand-in until a real engine is wired in).

It implements the `Engine` protocol honestly but minimally: prefill stamps the real Mamba
bytes (conv + SSM state, never the padding) of the request's Mamba block, in every region,
on every rank, with a pattern derived from (prompt, layer, byte); `check_state` compares those
bytes in decode's own blocks. Valid for pairs with equal TP (the stamp ignores sharding);
tokens are a deterministic function of the prompt, so tests can predict them.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from shared.cache.regions import RankCache
from shared.engine.protocol import DecodeSession, EnsureCapacity, RequestBlocks
from shared.layout.page import EngineLayout


def prompt_stamp(prompt: Sequence[int]) -> int:
    return zlib.crc32(b"".join(int(t).to_bytes(4, "little") for t in prompt))


def expected_tokens(prompt: Sequence[int], n: int, vocab: int) -> list[int]:
    s = prompt_stamp(prompt)
    return [(s + 7 * i) % vocab for i in range(n)]


class _Session:
    def __init__(self, prompt: Sequence[int], vocab: int, ensure: EnsureCapacity) -> None:
        self.prompt = list(prompt)
        self.vocab = vocab
        self.ensure = ensure
        self.i = 0

    def step(self) -> int:
        self.ensure(len(self.prompt) + self.i + 1)
        token = expected_tokens(self.prompt, self.i + 1, self.vocab)[-1]
        self.i += 1
        return token


class StampEngine:
    eos_token_ids: frozenset[int] = frozenset()
    samples = False
    boundary = "n-1"
    tokenizer = None  # the byte tokenizer

    def __init__(self, layout: EngineLayout, caches: Sequence[RankCache]) -> None:
        self.spec = layout.spec
        self.layout = layout
        self.caches = list(caches)
        self.prefills = 0

    def prefix_stable_unit(self, prefill_chunk_tokens: int) -> int | None:
        return None

    def num_prefill_tokens(self, prompt_len: int) -> int:
        return prompt_len - 1

    def _pattern(self, prompt: Sequence[int], layer: int) -> torch.Tensor:
        n = self.layout.mamba_bytes
        base = prompt_stamp(prompt) + 131 * layer
        return ((torch.arange(n, dtype=torch.int64) * 31 + base) % 251).to(torch.uint8)

    def _mamba_pages(self, blocks: RequestBlocks) -> list[tuple[int, torch.Tensor]]:
        pages = []
        for g in self.layout.mamba_group_ids:
            block = int(blocks.block_ids[g][0])
            for region, layer in enumerate(self.layout.groups[g].layers):
                for cache in self.caches:
                    pages.append((layer, cache.page(region, block)[: self.layout.mamba_bytes]))
        return pages

    def prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: Any = None) -> None:
        for layer, page in self._mamba_pages(blocks):
            page.copy_(self._pattern(prompt, layer))
        self.prefills += 1

    def start_decode(
        self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, ensure_capacity: EnsureCapacity, **_: Any
    ) -> DecodeSession:
        return _Session(prompt, self.spec.vocab_size, ensure_capacity)

    def check_state(
        self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, *, chunk_tokens: int | None = None
    ) -> list[str]:
        return [
            f"layer {layer}: {int((page != self._pattern(prompt, layer)).sum())} bytes differ"
            for layer, page in self._mamba_pages(blocks)
            if not torch.equal(page, self._pattern(prompt, layer))
        ]


class SlowStamp(StampEngine):
    """FAKE: prefill and decode steps take a while, so a test can act in the middle."""

    prefill_seconds = 0.3
    step_seconds = 0.02

    def prefill(self, prompt: Sequence[int], blocks: RequestBlocks, sampling: Any = None) -> None:
        time.sleep(self.prefill_seconds)
        super().prefill(prompt, blocks)

    def start_decode(self, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, ensure: Any, **kw: Any) -> Any:
        session = super().start_decode(prompt, num_computed, blocks, ensure, **kw)
        step = session.step

        def slow_step() -> int:
            time.sleep(self.step_seconds)
            return int(step())

        session.step = slow_step  # type: ignore[method-assign]
        return session
