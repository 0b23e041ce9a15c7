"""transformers' cache <-> our layouts: shapes, the conv window (K columns vs K-1), GDN's
orientation, and a lossless round trip through the paged blocks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from shared.engine.hf.cache_state import build_cache, extract_state
from shared.engine.hf.tiny_checkpoints import FAMILIES
from shared.engine.protocol import RequestBlocks
from shared.layout.shapes import global_conv_dim, global_ssm_shape
from shared.layout.spec import GDNDims
from tests.unit.engine_hf.helpers import blocks_for, checkpoint, engine, spec_of

PROMPT = [5, 9, 17, 33, 4, 60, 71, 8, 90, 12, 13]


@pytest.mark.parametrize("family", FAMILIES)
def test_state_shapes_conv_window_and_orientation(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    ckpt, spec = checkpoint(directory), spec_of(directory)
    cache = ckpt.new_cache()
    ckpt.forward(PROMPT, 0, cache)
    state = extract_state(cache, spec, len(PROMPT))
    assert set(state.kv) == set(spec.attention_layers) and set(state.ssm) == set(spec.ssm_layers)
    for layer in spec.ssm_layers:
        conv, rec = state.ssm[layer]
        hf_conv, hf_rec = cache.get_conv_state(layer), cache.get_recurrent_state(layer)
        # transformers keeps K columns (oldest first); ours are its newest K-1.
        assert hf_conv.shape[-1] == spec.ssm.conv_kernel
        assert conv.shape == (global_conv_dim(spec), spec.ssm.conv_kernel - 1)
        assert torch.equal(conv, hf_conv[0, :, 1:])
        assert rec.shape == global_ssm_shape(spec)
        if isinstance(spec.ssm, GDNDims):  # ours (Hv, Dv, Dk), transformers' (Hv, Dk, Dv)
            assert torch.equal(rec, hf_rec[0].transpose(-1, -2))
            assert spec.ssm.head_k_dim != spec.ssm.head_v_dim  # so a missing transpose could not pass
        else:
            assert torch.equal(rec, hf_rec[0])
    for layer in spec.attention_layers:
        k, _ = state.kv[layer]
        assert k.shape == (len(PROMPT), spec.attention.num_kv_heads, spec.attention.head_dim)


@pytest.mark.parametrize("family", ["nemotron_h", "jamba", "qwen3_5_text", "falcon_h1"])
def test_the_column_transformers_keeps_beyond_ours_never_enters_a_result(
    family: str, hf_checkpoint: Callable[[str], str]
) -> None:
    directory = hf_checkpoint(family)
    ckpt, spec = checkpoint(directory), spec_of(directory)
    cache = ckpt.new_cache()
    ckpt.forward(PROMPT, 0, cache)
    state = extract_state(cache, spec, len(PROMPT))
    expected = ckpt.forward([21], len(PROMPT), cache)

    def next_logits(column: int, value: float) -> torch.Tensor:
        rebuilt = build_cache(ckpt.config, spec, state)
        for layer in spec.ssm_layers:
            rebuilt.get_conv_state(layer)[..., column] = value
        return ckpt.forward([21], len(PROMPT), rebuilt)

    assert torch.equal(next_logits(0, 1e3), expected)  # the oldest of K: shifted out unused
    assert not torch.equal(next_logits(1, 1e3), expected)  # the oldest of our K-1: used


@pytest.mark.parametrize("family", ["bamba", "qwen3_5", "jamba"])
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_blocks_hold_the_state_without_losing_a_bit(
    family: str, tp: int, dtype: str, hf_checkpoint: Callable[[str], str]
) -> None:
    directory = hf_checkpoint(family)
    eng = engine(directory, tp, dtype=dtype)
    blocks = blocks_for(eng.layout, len(PROMPT))
    eng.prefill(PROMPT, blocks)
    want, _ = eng.compute_prefix(PROMPT, len(PROMPT))
    got = eng.read_state(blocks, len(PROMPT))
    for layer, (k, v) in want.kv.items():
        assert torch.equal(got.kv[layer][0], k) and torch.equal(got.kv[layer][1], v)
        assert got.kv[layer][0].dtype == k.dtype
    for layer, (conv, rec) in want.ssm.items():
        assert torch.equal(got.ssm[layer][0], conv) and torch.equal(got.ssm[layer][1], rec)
        assert (got.ssm[layer][0].dtype, got.ssm[layer][1].dtype) == (conv.dtype, rec.dtype)
    assert eng.check_state(PROMPT, len(PROMPT), blocks) == []
    # The check can fail: one value of one rank's recurrent state changed is reported.
    layer = eng.spec.ssm_layers[0]
    region = eng.layout.region_of("mamba", layer)
    block = int(blocks.block_ids[eng.layout.group_of("mamba", layer)][0])
    eng.ranks[-1].ssm[region][block].view(-1)[0] += 1.0
    assert any("SSM state differs" in p for p in eng.check_state(PROMPT, len(PROMPT), blocks))


@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_next"])
def test_decode_grows_its_blocks_and_mirrors_every_new_k_v_into_them(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    eng = engine(directory, 2)
    bs = eng.layout.block_size
    prompt = [(3 * i) % 150 + 4 for i in range(bs - 2)]
    blocks = blocks_for(eng.layout, len(prompt))
    first = eng.prefill(prompt, blocks)
    asked: list[int] = []
    spare = iter(range(20, 24))
    attention = [g for g, group in enumerate(eng.layout.groups) if group.kind == "attention"]

    def grow(num_tokens: int) -> RequestBlocks:
        asked.append(num_tokens)
        for g in attention:
            have = blocks.block_ids[g]
            extra = [next(spare) for _ in range(-(-num_tokens // bs) - len(have))]
            blocks.block_ids[g] = np.concatenate([have, extra]).astype(np.int64)
        return blocks

    session = eng.start_decode(prompt, len(prompt), blocks, grow, first_token=first)
    for _ in range(5):
        session.step()
    assert asked == list(range(len(prompt) + 1, len(prompt) + 6))  # before each write
    assert all(len(session.blocks.block_ids[g]) == 2 for g in attention)  # crossed into a second block
    held = session.state()
    mirrored = eng.read_state(session.blocks, session.num_tokens)
    for layer, (k, v) in held.kv.items():
        assert torch.equal(mirrored.kv[layer][0], k) and torch.equal(mirrored.kv[layer][1], v)
