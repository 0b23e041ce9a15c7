"""The paged engine's contract: step_batch equals stepping one by one, chunked prefill gives
prefill's bits and reports every layer in order, TP only moves bytes, and the blocks are all
decode needs (a copy of them under other block ids decodes the same)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.engine.paged import families
from shared.engine.paged.checkpoint import PagedCheckpoint
from shared.engine.paged.engine import PagedEngine
from shared.engine.paged.families import SUPPORTED_FAMILIES, UnsupportedFamily
from shared.engine.paged_state import PagedStateStore
from shared.engine.protocol import BatchedDecode, ChunkedPrefill, RequestBlocks
from tests.unit.engine_batched.helpers import BlockPool, logits_of, paged_engine, prompt_of, start
from tests.unit.engine_hf.helpers import spec_of

STEPS = 5
LENGTHS = (1, 5, 18, 33)


def _state(engine: PagedEngine, blocks: RequestBlocks, length: int) -> list[torch.Tensor]:
    store = PagedStateStore(engine.layout, engine.ranks, blocks)
    out: list[torch.Tensor] = []
    for layer in engine.spec.attention_layers:
        out += store.read_kv(layer, length)
    for layer in engine.spec.ssm_layers:
        out += store.read_ssm(layer)
    return out


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_step_batch_equals_steps_one_by_one(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    for boundary in ("full", "n-1"):
        together, alone = paged_engine(directory, boundary=boundary), paged_engine(directory, boundary=boundary)
        assert isinstance(together, BatchedDecode) and isinstance(together, ChunkedPrefill)
        pool_t, pool_a = BlockPool(together.layout), BlockPool(alone.layout)
        batch = [start(together, pool_t, prompt_of(n, salt=n), f"r{n}")[0] for n in LENGTHS]
        single = [start(alone, pool_a, prompt_of(n, salt=n), f"r{n}")[0] for n in LENGTHS]
        for _ in range(STEPS):
            tokens = together.step_batch(batch)
            assert tokens == [s.step() for s in single]
            for a, b in zip(batch, single):
                assert torch.equal(logits_of(a), logits_of(b))


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_chunked_prefill_gives_prefill_bits_and_reports_layers(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    chunk = 8
    engine = paged_engine(directory, chunk=chunk)
    pool = BlockPool(engine.layout)
    prompt = prompt_of(29)
    whole = pool.blocks(len(prompt))
    first = engine.prefill(prompt, whole)
    parts = pool.blocks(len(prompt))
    run = engine.start_prefill(prompt, parts)
    reported: list[int] = []
    got = None
    for end in (8, 16, 24, 29):
        got = run.compute(end, reported.append)
        assert reported == ([] if end < 29 else list(range(engine.spec.num_layers)))
    assert got == first is not None
    for a, b in zip(_state(engine, whole, len(prompt)), _state(engine, parts, len(prompt))):
        assert torch.equal(a, b)
    assert engine.check_state(prompt, len(prompt), parts) == []
    # The check can fail: a damaged SSM state is named.
    store = PagedStateStore(engine.layout, engine.ranks, parts)
    layer = engine.spec.ssm_layers[0]
    conv, ssm = store.read_ssm(layer)
    store.write_ssm(layer, conv, ssm + 1)
    assert any("SSM state" in p for p in engine.check_state(prompt, len(prompt), parts))


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_tp_only_moves_bytes(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    runs = []
    for tp in (1, 2):
        engine = paged_engine(directory, tp)
        pool = BlockPool(engine.layout)
        sessions = [start(engine, pool, prompt_of(n, salt=n), f"r{n}") for n in LENGTHS]
        tokens = [[first] for _, first in sessions]
        for _ in range(STEPS):
            for out, t in zip(tokens, engine.step_batch([s for s, _ in sessions])):
                out.append(t)
        runs.append(tokens)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_decode_from_a_copy_of_the_blocks(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    """Prefill's blocks copied byte for byte into other block ids (what a transfer does): the
    decode from the copy gives the tokens of the decode from the originals."""
    directory = hf_checkpoint(family)
    for boundary in ("full", "n-1"):
        engine = paged_engine(directory, boundary=boundary)
        pool = BlockPool(engine.layout)
        prompt = prompt_of(21)
        src = pool.blocks(len(prompt))
        first = engine.prefill(prompt, src)
        pool.next += 7  # other ids, not adjacent
        dst = pool.blocks(len(prompt))
        for rank in engine.ranks:
            for region in range(engine.layout.num_regions):
                for s_ids, d_ids in zip(src.block_ids, dst.block_ids):
                    _copy_pages(rank, region, s_ids, d_ids)
        n = engine.num_prefill_tokens(len(prompt))
        runs = []
        for blocks in (src, dst):
            holder = [blocks]
            session = engine.start_decode(prompt, n, blocks, pool.grower(holder), first_token=first)
            runs.append([session.step() for _ in range(STEPS)])
        assert runs[0] == runs[1]


def _copy_pages(rank: object, region: int, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy whole logical pages of one region (every byte of K/V or conv + SSM state)."""
    views = rank.ssm[region]  # type: ignore[attr-defined]
    convs = rank.conv[region]  # type: ignore[attr-defined]
    fa = rank.fa[region]  # type: ignore[attr-defined]
    per = fa.shape[0] // convs.shape[0]
    for s, d in zip(src.tolist(), dst.tolist()):
        fa[d * per : (d + 1) * per] = fa[s * per : (s + 1) * per].clone()
        convs[d] = convs[s].clone()
        views[d] = views[s].clone()


def test_unsupported_family_is_refused(
    hf_checkpoint: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At load, before any weight is read, naming the family and who serves it."""
    directory = tmp_path / "llama"
    shutil.copytree(hf_checkpoint("nemotron_h"), directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(UnsupportedFamily, match=r"'llama'.*no engine of this project"):
        PagedCheckpoint(str(directory), dtype="fp32")
    # A hybrid family transformers runs but this engine would not: the hf engine is named.
    monkeypatch.delitem(families.BUILDERS, "jamba")
    with pytest.raises(UnsupportedFamily, match=r"'jamba'.*--engine hf"):
        PagedCheckpoint(hf_checkpoint("jamba"), dtype="fp32")


def test_the_factory_builds_it_and_the_family_lists_agree(hf_checkpoint: Callable[[str], str]) -> None:
    from shared.cache.model_views import RankViews
    from shared.cache.regions import RankCache
    from shared.engine.factory import ENGINE_KINDS, make_engine
    from shared.engine.paged.support import PAGED_FAMILIES, paged_serves
    from shared.layout.page import build_engine_layout

    assert PAGED_FAMILIES == SUPPORTED_FAMILIES and "paged" in ENGINE_KINDS
    directory = hf_checkpoint("nemotron_h")
    assert paged_serves(directory)
    layout = build_engine_layout(spec_of(directory), 1)
    views = [RankViews(layout, RankCache(layout.num_regions, 8, layout.page_bytes, huge_pages=False))]
    engine = make_engine(
        "paged", layout, views, model_dir=directory, boundary="full", batch_invariant=False, decode_threads=2, prefill_threads=3
    )
    assert isinstance(engine, PagedEngine) and engine.boundary == "full" and not engine.batch_invariant
    assert engine.decode_threads == 2 and engine.prefill_threads == 3


def test_routed_experts_and_fixed_rope_types_are_served(tmp_path: Path) -> None:
    from shared.engine.paged.support import paged_serves, unsupported_feature

    assert unsupported_feature({"model_type": "nemotron_h", "layers_block_type": ["mamba", "moe"]}) is None
    assert unsupported_feature({"model_type": "nemotron_h", "hybrid_override_pattern": "M-ME*"}) is None
    for kind in ("default", "linear", "llama3", "yarn"):
        assert unsupported_feature({"model_type": "bamba", "rope_parameters": {"rope_type": kind}}) is None
        assert unsupported_feature({"model_type": "bamba", "rope_scaling": {"type": kind}}) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nemotron_h", "hybrid_override_pattern": "M-ME*"}))
    assert paged_serves(str(tmp_path))


def test_rope_that_follows_the_sequence_length_defaults_to_hf(variant_checkpoint: Callable[[str], str]) -> None:
    """Dynamic NTK and LongRoPE change their frequencies with the running sequence length: named
    precisely, left to the hf engine by default, refused by the paged one; the hf engine runs them."""
    from shared.config.settings import default_engine
    from shared.engine.hf.tiny_checkpoints import VARIANTS
    from shared.engine.paged.support import paged_serves, unsupported_feature
    from tests.unit.engine_batched.variants import HF_ONLY_VARIANTS, PAGED_VARIANTS
    from tests.unit.engine_hf.helpers import blocks_for
    from tests.unit.engine_hf.helpers import engine as hf_engine

    assert sorted(PAGED_VARIANTS + HF_ONLY_VARIANTS) == sorted(VARIANTS)
    dynamic = unsupported_feature({"model_type": "bamba", "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert dynamic is not None and dynamic.startswith("rope_scaling rope_type 'dynamic' (dynamic NTK")
    longrope = unsupported_feature({"model_type": "qwen3_next", "rope_parameters": {"rope_type": "longrope"}})
    assert longrope is not None and longrope.startswith("rope_parameters rope_type 'longrope' (LongRoPE")
    other = unsupported_feature({"model_type": "bamba", "rope_parameters": {"rope_type": "proportional"}})
    assert other == "rope_parameters rope_type 'proportional' (the paged engine computes default, linear, llama3, yarn)"
    for variant in HF_ONLY_VARIANTS:
        directory = variant_checkpoint(variant)
        assert not paged_serves(directory) and default_engine(directory) == "hf"
        kind = variant.removeprefix("rope-")
        with pytest.raises(UnsupportedFamily, match=rf"rope_type '{kind}' \(.*sequence.*\).*--engine hf"):
            PagedCheckpoint(directory, dtype="fp32")
        engine = hf_engine(directory, 1)
        prompt = prompt_of(9)
        first = engine.prefill(prompt, blocks_for(engine.layout, len(prompt)))
        assert first is not None and 0 <= first < engine.checkpoint.vocab_size


@pytest.mark.parametrize("family", ["nemotron_h", "jamba", "qwen3_5"])
def test_a_restored_prefix_feeds_the_rest_of_the_prompt(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    """n-1 with state for only k < N-1 tokens (a prefix restored from a cache): the session's
    first step feeds the rest of the prompt on its own inside step_batch, beside one-token
    sessions, and continues as a full prefill would (to the tolerance of a scan cut elsewhere)."""
    directory = hf_checkpoint(family)
    engine = paged_engine(directory, boundary="n-1")
    pool = BlockPool(engine.layout)
    prompt, k = prompt_of(20), 7
    whole, _ = start(engine, pool, prompt, "whole")
    holder = [pool.blocks(len(prompt), "prefix")]
    engine.prefill(prompt[: k + 1], holder[0])  # computes k tokens
    restored = engine.start_decode(prompt, k, holder[0], pool.grower(holder))
    other, _ = start(engine, pool, prompt_of(5, salt=3), "other")
    for _ in range(3):
        a, b, _c = engine.step_batch([whole, restored, other])
        assert a == b
        assert float((logits_of(whole) - logits_of(restored)).abs().max()) < 1e-4
    assert restored.num_tokens == whole.num_tokens == len(prompt) + 2


def test_the_one_rank_kv_read_equals_the_general_one(hf_checkpoint: Callable[[str], str]) -> None:
    """At TP 1 a step reads K/V as slices of the gathered blocks (`_whole_kv`); the general path
    (a gather per rank, then the tokens picked out) must give the same tensors."""
    from shared.engine.paged_state import read_kv_many

    engine = paged_engine(hf_checkpoint("nemotron_h"))
    pool = BlockPool(engine.layout)
    sessions = [start(engine, pool, prompt_of(3 + 17 * i, salt=i), f"r{i}")[0] for i in range(5)]
    stores, lengths = [s._store for s in sessions], [s.num_tokens for s in sessions]
    layer = engine.spec.attention_layers[0]
    assert all(s._whole_kv for s in stores)
    fast = read_kv_many(stores, layer, lengths, engine.model.dtype)
    for s in stores:
        s._whole_kv = False
    general = read_kv_many(stores, layer, lengths, engine.model.dtype)
    assert [k.shape[0] for k, _ in fast] == lengths
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(fast, general))


def test_the_head_major_step_read_equals_the_general_one(hf_checkpoint: Callable[[str], str]) -> None:
    """A step's attention reads K/V head-major (`read_kv_heads`): at TP 1 one gather of token rows
    into a span per request (K, then V), which must hold the general read's values, start on 64 bytes and
    have strides of the request's own length only (the other requests change neither)."""
    from shared.engine.paged_state import read_kv_heads, read_kv_many

    engine = paged_engine(hf_checkpoint("nemotron_h"))
    pool = BlockPool(engine.layout)
    sessions = [start(engine, pool, prompt_of(3 + 17 * i, salt=i), f"r{i}")[0] for i in range(5)]
    stores, lengths = [s._store for s in sessions], [s.num_tokens for s in sessions]
    layer = engine.spec.attention_layers[0]
    heads = read_kv_heads(stores, layer, lengths, engine.model.dtype)
    general = read_kv_many(stores, layer, lengths, engine.model.dtype)
    for (k, v), (gk, gv), n in zip(heads, general, lengths):
        assert torch.equal(k, gk.transpose(0, 1)) and torch.equal(v, gv.transpose(0, 1))
        assert k.data_ptr() % 64 == 0 and v.data_ptr() - k.data_ptr() == k.numel() * k.element_size()
        assert k.stride() == v.stride() == (n * k.shape[2], k.shape[2], 1)
    alone = read_kv_heads(stores[2:3], layer, lengths[2:3], engine.model.dtype)[0]
    assert torch.equal(alone[0], heads[2][0]) and alone[0].stride() == heads[2][0].stride()
