"""Engine-level pairs for the hf engine: two engines on their own paged caches (any TP), and a
transfer that executes the layout's read lists byte for byte, as NIXL's READ would."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.engine.hf.checkpoint import HfCheckpoint
from shared.engine.hf.engine import HfEngine
from shared.engine.hf.model_spec import hf_model_spec
from shared.engine.protocol import RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams
from shared.layout.boundary import Boundary
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.plan import build_plan
from shared.layout.read_lists import build_read_lists, read_indices
from shared.layout.spec import ModelSpec

NUM_BLOCKS = 24


@lru_cache(maxsize=32)
def checkpoint(directory: str, dtype: str = "fp32") -> HfCheckpoint:
    return HfCheckpoint(directory, dtype=dtype)


@lru_cache(maxsize=32)
def spec_of(directory: str, dtype: str = "fp32") -> ModelSpec:
    return hf_model_spec(directory, dtype=dtype)


def transformers_generate(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[Tensor]]:
    """transformers' own greedy generate(do_sample=False), which stops at generation_config's
    EOS as decode does: the generated tokens and each step's logits."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


def engine(
    directory: str,
    tp: int,
    *,
    dtype: str = "fp32",
    boundary: Boundary = "full",
    block_size: int | None = None,
    kernel_block_size: int | None = None,
) -> HfEngine:
    layout = build_engine_layout(spec_of(directory, dtype), tp, block_size=block_size, kernel_block_size=kernel_block_size)
    ranks = [RankViews(layout, RankCache(layout.num_regions, NUM_BLOCKS, layout.page_bytes, huge_pages=False)) for _ in range(tp)]
    return HfEngine(layout, ranks, checkpoint(directory, dtype), boundary=boundary)


def blocks_for(layout: EngineLayout, tokens: int, first: int = 1) -> RequestBlocks:
    """Blocks for `tokens` tokens, from id `first` on (scattered ids are not needed here)."""
    n = -(-max(tokens, 1) // layout.block_size)
    ids, nxt = [], first
    for group in layout.groups:
        if group.kind == "attention":
            ids.append(np.arange(nxt, nxt + n))
            nxt += n
        else:
            ids.append(np.array([nxt]))
            nxt += 1
    return RequestBlocks("req", ids)


def transfer(prefill: HfEngine, p_blocks: RequestBlocks, decode: HfEngine, d_blocks: RequestBlocks, num_tokens: int) -> int:
    """Copy the request's state from prefill's caches into decode's with the plan's descriptors
    (what one READ per (decode rank, prefill rank) moves). Returns the bytes moved."""
    plan = build_plan(prefill.layout, decode.layout)
    moved = 0
    for d, rank_plan in enumerate(plan.ranks):
        for read in rank_plan.reads:
            p = read.prefill_rank
            lists = build_read_lists(
                plan,
                d,
                p,
                local_bases=decode.ranks[d].cache.base_addresses(),
                remote_bases=prefill.ranks[p].cache.base_addresses(),
                local_num_blocks=NUM_BLOCKS,
                remote_num_blocks=NUM_BLOCKS,
            )
            local_idx, remote_idx = read_indices(lists, d_blocks.block_ids, p_blocks.block_ids, num_tokens)
            for li, ri in zip(local_idx.tolist(), remote_idx.tolist()):
                (dst, size), (src, size_r) = lists.local[li], lists.remote[ri]
                assert size == size_r
                ctypes.memmove(int(dst), int(src), int(size))
                moved += int(size)
    return moved


class Run:
    """One request through a prefill engine, the byte transfer and a decode engine."""

    def __init__(self, tokens: list[int], logits: list[Tensor | None], moved: int) -> None:
        self.tokens = tokens
        self.logits = logits
        self.moved = moved


def disaggregated(
    prefill: HfEngine,
    decode: HfEngine,
    prompt: list[int],
    max_tokens: int,
    *,
    sampling: SamplingParams = GREEDY,
    tamper: Callable[[HfEngine, RequestBlocks], None] | None = None,
) -> Run:
    """Tokens (and per-token logits; None for the one prefill sampled) of the disaggregated run;
    `tamper(decode, blocks)` may change decode's blocks after the transfer (negative controls)."""
    params = sampling
    p_blocks = blocks_for(prefill.layout, len(prompt))
    d_blocks = blocks_for(decode.layout, len(prompt), first=2)
    first = prefill.prefill(prompt, p_blocks, params)
    n = prefill.num_prefill_tokens(len(prompt))
    moved = transfer(prefill, p_blocks, decode, d_blocks, n)
    if tamper is not None:
        tamper(decode, d_blocks)
    spare = iter(range(int(max(ids.max() for ids in d_blocks.block_ids)) + 1, NUM_BLOCKS))
    state = {"blocks": d_blocks}

    def grow(num_tokens: int) -> RequestBlocks:
        blocks = state["blocks"]
        need = -(-num_tokens // decode.layout.block_size)
        ids = [
            np.concatenate([have, [next(spare) for _ in range(need - len(have))]])
            if g.kind == "attention" and need > len(have)
            else have
            for have, g in zip(blocks.block_ids, decode.layout.groups)
        ]
        state["blocks"] = RequestBlocks(blocks.request_id, ids)
        return state["blocks"]

    session = decode.start_decode(prompt, n, d_blocks, grow, sampling=params, first_token=first)
    tokens: list[int] = [] if first is None else [first]
    logits: list[Tensor | None] = [] if first is None else [None]
    while len(tokens) < max_tokens:
        tokens.append(session.step())
        logits.append(session.last_logits)
    return Run(tokens, logits, moved)
