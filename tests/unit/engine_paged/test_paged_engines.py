"""The engines on paged, TP-sharded caches: state round trips, checks that can fail, TP independence."""

from __future__ import annotations

import numpy as np
import pytest

from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.engine.paged_state import PagedStateStore
from shared.engine.protocol import ChunkedPrefill, RequestBlocks
from shared.engine.reference.colocated import cached_model, colocated_generate
from shared.engine.reference.state_store import read_global_state
from shared.engine.reference_engine import ReferenceEngine
from shared.engine.synthetic import SyntheticEngine
from shared.layout.models import load_model
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.presets import TINY_PRESETS

PROMPT = list(b"The quick brown fox jumps")


def make_ranks(layout: EngineLayout, num_blocks: int = 24) -> list[RankViews]:
    return [RankViews(layout, RankCache(layout.num_regions, num_blocks, layout.page_bytes)) for _ in range(layout.tp)]


def request_blocks(layout: EngineLayout, tokens: int, first: int = 1) -> RequestBlocks:
    n = -(-tokens // layout.block_size)
    ids = []
    for gi, group in enumerate(layout.groups):
        ids.append(np.arange(first, first + n) if group.kind == "attention" else np.array([first + n + gi]))
    return RequestBlocks("req", ids)


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_paged_store_holds_the_same_state_as_a_dense_store(name: str, tp: int) -> None:
    spec = TINY_PRESETS[name]
    layout = build_engine_layout(spec, tp)
    store = PagedStateStore(layout, make_ranks(layout), request_blocks(layout, len(PROMPT)))
    store.reset_ssm()
    model = cached_model(spec)
    dense = model.new_store()
    model.prefill(PROMPT, dense)
    model.prefill(PROMPT, store)
    assert read_global_state(store, spec, len(PROMPT)).equal(read_global_state(dense, spec, len(PROMPT)))
    assert store.replica_mismatches(len(PROMPT)) == []


@pytest.mark.parametrize("name", ["tiny-mamba2-g1", "tiny-gdn"])
def test_reference_engine_decodes_colocated_tokens_and_its_check_catches_one_flipped_value(name: str) -> None:
    spec = TINY_PRESETS[name]
    layout = build_engine_layout(spec, 4)
    ranks = make_ranks(layout)
    engine = ReferenceEngine(layout, ranks)
    blocks = request_blocks(layout, len(PROMPT) + 12)
    engine.prefill(PROMPT, blocks)
    n = engine.num_prefill_tokens(len(PROMPT))
    assert n == len(PROMPT) - 1
    assert engine.check_state(PROMPT, n, blocks) == []
    session = engine.start_decode(PROMPT, n, blocks, lambda _: blocks)
    assert [session.step() for _ in range(12)] == colocated_generate(spec, PROMPT, 12)
    # Negative control: one value of one rank's SSM state changed must be reported.
    fresh = make_ranks(layout)
    engine = ReferenceEngine(layout, fresh)
    engine.prefill(PROMPT, blocks)
    layer = spec.ssm_layers[0]
    region = layout.region_of("mamba", layer)
    block = int(blocks.block_ids[layout.group_of("mamba", layer)][0])
    fresh[1].ssm[region][block].view(-1)[0] += 1.0
    assert any("SSM state differs" in p for p in engine.check_state(PROMPT, n, blocks))


@pytest.mark.parametrize(
    ("name", "tp", "rank"),
    [
        ("tiny-mamba2-g1", 2, 1),  # B/C replicated on every rank
        ("tiny-mamba2-g2", 4, 1),  # group 0 on ranks 0 and 1
        ("tiny-mamba2-g2", 4, 3),  # group 1 on ranks 2 and 3
        ("tiny-mamba2-g2", 8, 2),  # group 0 on ranks 0..3
    ],
)
def test_replicated_copies_that_disagree_are_reported(name: str, tp: int, rank: int) -> None:
    spec = TINY_PRESETS[name]
    layout = build_engine_layout(spec, tp)
    ranks = make_ranks(layout)
    engine = SyntheticEngine(layout, ranks)
    blocks = request_blocks(layout, len(PROMPT))
    engine.prefill(PROMPT, blocks)
    n = engine.num_prefill_tokens(len(PROMPT))
    assert engine.check_state(PROMPT, n, blocks) == []
    layer = spec.ssm_layers[0]
    region = layout.region_of("mamba", layer)
    block = int(blocks.block_ids[layout.group_of("mamba", layer)][0])
    b_row = layout.shapes.section_dims[0]  # first row of the B section on this rank
    ranks[rank].conv[region][block][b_row, 0] += 1.0
    problems = engine.check_state(PROMPT, n, blocks)
    assert any(f"differs on rank {rank}" in p for p in problems)


@pytest.mark.parametrize("name", ["nemotron-h-8b", "qwen3.5-0.8b", "jamba-mini-1.7", "falcon-h1-1.5b"])
def test_synthetic_engine_at_real_model_sizes_checks_every_byte(name: str) -> None:
    spec = load_model(name)
    layout = build_engine_layout(spec, 2)
    prompt = list(range(40))
    blocks = request_blocks(layout, len(prompt))
    ranks = make_ranks(layout, num_blocks=int(max(ids.max() for ids in blocks.block_ids)) + 1)
    engine = SyntheticEngine(layout, ranks)
    engine.prefill(prompt, blocks)
    n = engine.num_prefill_tokens(len(prompt))
    assert engine.check_state(prompt, n, blocks) == []
    tokens = [engine.start_decode(prompt, n, blocks, lambda _: blocks).step() for _ in range(2)]
    assert tokens[0] == tokens[1]  # deterministic
    layer = spec.attention_layers[0]
    first_block = int(blocks.block_ids[layout.group_of("attention", layer)][0])
    ranks[0].fa[layout.region_of("attention", layer)][first_block * layout.physical_per_logical, 1].view(-1)[3] += 1
    assert any("K/V of 1 positions differ" in p for p in engine.check_state(prompt, n, blocks))
    other = engine.start_decode(prompt, n, blocks, lambda _: blocks).step()
    assert other != tokens[0]  # tokens depend on the bytes decode holds


def test_replicated_kv_heads_that_disagree_are_reported() -> None:
    spec = TINY_PRESETS["tiny-mamba2"]  # 2 KV heads: at TP 4 ranks 0 and 1 both hold head 0
    layout = build_engine_layout(spec, 4)
    ranks = make_ranks(layout)
    engine = SyntheticEngine(layout, ranks)
    blocks = request_blocks(layout, len(PROMPT))
    engine.prefill(PROMPT, blocks)
    n = engine.num_prefill_tokens(len(PROMPT))
    assert engine.check_state(PROMPT, n, blocks) == []
    layer = spec.attention_layers[0]
    first_block = int(blocks.block_ids[layout.group_of("attention", layer)][0])
    ranks[1].fa[layout.region_of("attention", layer)][first_block * layout.physical_per_logical, 0, 0, 0, 0] += 1.0
    assert "layer 1: KV head 0 differs on rank 1" in engine.check_state(PROMPT, n, blocks)


@pytest.mark.parametrize("chunks", [[1, 16, 17, 33, 70], [5, 70], [70]])
def test_synthetic_prefill_in_chunks_writes_the_bytes_of_one_pass(chunks: list[int]) -> None:
    spec = TINY_PRESETS["tiny-mamba2"]
    layout = build_engine_layout(spec, 2)
    prompt = list(range(71))  # 70 computed at the n-1 boundary
    blocks = request_blocks(layout, len(prompt))
    whole, parts = make_ranks(layout), make_ranks(layout)
    SyntheticEngine(layout, whole).prefill(prompt, blocks)
    engine = SyntheticEngine(layout, parts)
    assert isinstance(engine, ChunkedPrefill) and engine.exact_chunk_tokens is None
    run = engine.start_prefill(prompt, blocks)
    for end in chunks:
        run.compute(end)
    for a, b in zip(whole, parts):
        assert all(x.equal(y) for x, y in zip(a.cache.regions, b.cache.regions))
    assert engine.check_state(prompt, 70, blocks) == []
    with pytest.raises(ValueError, match="outside the 70 tokens"):
        run.compute(71)


def test_a_synthetic_prefill_stopped_early_is_caught_and_tiles_are_per_position() -> None:
    spec = TINY_PRESETS["tiny-mamba2"]
    layout = build_engine_layout(spec, 1)
    prompt = list(range(71))
    blocks = request_blocks(layout, len(prompt))
    engine = SyntheticEngine(layout, make_ranks(layout))
    run = engine.start_prefill(prompt, blocks)
    run.compute(40)  # stopped before the last chunk: positions 40..69 and the SSM state unwritten
    problems = engine.check_state(prompt, 70, blocks)
    assert any("K/V of 30 positions differ (first at 40)" in p for p in problems)
    assert any("SSM state differs" in p for p in problems)
    # One position's K/V drawn for another position's tile would differ: tiles are per position.
    k_a, _ = engine.expected_kv(prompt, spec.attention_layers[0], 16, 1)
    k_b, _ = engine.expected_kv(prompt, spec.attention_layers[0], 0, 17)
    assert k_a.equal(k_b[16:]) and not k_a.equal(k_b[15:16])
