"""Byte and descriptor counts from the layout math: sizing, sections, coalescing, crossover."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

from hybridpd_tools.bench.crossover import bytes_by_prompt_length
from hybridpd_tools.bench.pairs import PairRead, fake_bases, pair_lists, request_reads, total_sections
from hybridpd_tools.bench.raw_nixl import coalesce_per_region
from hybridpd_tools.bench.sizing import blocks_needed, blocks_per_group, prefill_tokens, request_blocks
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.plan import build_plan
from shared.layout.presets import get_preset

pytestmark = pytest.mark.timeout(60)


def test_request_blocks_are_one_contiguous_run_split_by_group() -> None:
    layout = build_engine_layout(get_preset("tiny-mamba2"), 1, kernel_block_size=16)
    tokens = 3 * layout.block_size + 1
    blocks = request_blocks(layout, tokens, first=5)
    assert [len(b) for b in blocks] == blocks_per_group(layout, tokens)
    assert np.array_equal(np.concatenate(blocks), np.arange(5, 5 + blocks_needed(layout, tokens)))
    assert [len(b) for b, g in zip(blocks, layout.groups) if g.kind == "attention"] == [4]
    assert prefill_tokens(layout.spec, 10) == 9  # SSM models: decode recomputes the last token


@dataclass
class Setup:
    reads: list[PairRead]
    prefill: EngineLayout
    local_bases: list[npt.NDArray[np.int64]]
    remote_bases: list[npt.NDArray[np.int64]]
    local_region_bytes: int


def setup(model: str, p_tp: int, d_tp: int, tokens: int) -> Setup:
    spec = get_preset(model)
    pre, dec = build_engine_layout(spec, p_tp, kernel_block_size=16), build_engine_layout(spec, d_tp, kernel_block_size=16)
    n = blocks_needed(dec, tokens) + 2
    local_bases = fake_bases(d_tp, dec.num_regions, dec.region_bytes(n), side=1)
    remote_bases = fake_bases(p_tp, pre.num_regions, pre.region_bytes(n), side=2)
    pairs = pair_lists(
        build_plan(pre, dec), local_bases=local_bases, remote_bases=remote_bases, local_num_blocks=n, remote_num_blocks=n
    )
    reads = request_reads(pairs, request_blocks(dec, tokens), request_blocks(pre, tokens), tokens)
    return Setup(reads, pre, local_bases, remote_bases, dec.region_bytes(n))


def test_sections_add_up_and_match_the_model_at_tp1() -> None:
    s = setup("tiny-mamba2", 1, 1, 40)
    sections = total_sections(s.reads)
    assert sections.total == sum(r.nbytes for r in s.reads)
    spec, shapes = s.prefill.spec, s.prefill.shapes
    units = -(-40 // 16) * 16  # K/V move whole 16-token units
    kv = 2 * spec.attention.num_kv_heads * spec.attention.head_dim * 4  # fp32 K and V, per token and layer
    assert sections.fa == len(spec.attention_layers) * units * kv
    assert sections.conv == len(spec.ssm_layers) * shapes.conv_bytes
    assert sections.ssm == len(spec.ssm_layers) * shapes.ssm_bytes


def test_coalescing_keeps_the_bytes_of_each_region() -> None:
    s = setup("tiny-gdn", 1, 2, 70)
    assert len(s.reads) == 2
    for r in s.reads:
        lists = r.pair.lists
        local_bases, remote_bases = s.local_bases[r.pair.decode_rank], s.remote_bases[r.pair.prefill_rank]
        # Region lookup must not assume ascending base addresses: give them in reverse.
        local, remote = coalesce_per_region(lists.local, r.local_idx, local_bases[::-1], remote_bases[::-1])
        assert int(local[:, 1].sum()) == r.nbytes
        assert np.array_equal(local[:, 1], remote[:, 1])
        # Slow obvious reference: each selected descriptor's bytes, summed per region it lies in.
        expected: dict[int, int] = {}
        for addr, length in lists.local[r.local_idx]:
            base = next(int(b) for b in local_bases if b <= addr < b + s.local_region_bytes)
            expected[base] = expected.get(base, 0) + int(length)
        assert {int(b): int(n) for b, n in local} == expected
        remote_of = dict(zip(local_bases.tolist(), remote_bases.tolist()))
        assert [remote_of[int(b)] for b in local[:, 0]] == remote[:, 0].tolist()  # region j <-> region j
        assert len(local) <= len(local_bases)


def test_crossover_fa_grows_state_does_not() -> None:
    layout = build_engine_layout(get_preset("nemotron-3-nano-30b-a3b"), 1, kernel_block_size=16)
    x = bytes_by_prompt_length(layout, layout, (256, 1024, 4096, 16384))
    fa = [p.bytes.fa for p in x.points]
    assert fa == sorted(fa) and fa[-1] > 10 * fa[0]
    assert len({p.bytes.conv + p.bytes.ssm for p in x.points}) == 1
    assert x.crossover_tokens == 16384
    estimate = x.crossover_estimate_tokens
    assert estimate is not None and 4096 < estimate <= 16384
    short = bytes_by_prompt_length(layout, layout, (16, 32))
    assert short.crossover_tokens is None and short.crossover_estimate_tokens is None
