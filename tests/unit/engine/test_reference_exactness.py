"""Bit-exactness of the reference engine: any prefill/decode split, the N-1 protocol, determinism.

Every comparison here is exact (token ids, or tensor bytes), never a tolerance.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from shared.engine.reference import (
    DenseStateStore,
    ReferenceModel,
    cached_model,
    colocated_generate,
    conv_state_shape,
    decode_part,
    encode,
    prefill_part,
    read_global_state,
    split_generate,
    ssm_state_shape,
    write_global_state,
)
from shared.layout.presets import TINY_PRESETS, pattern_to_kinds
from shared.layout.spec import ModelSpec

pytestmark = pytest.mark.timeout(120)
PRESETS = sorted(TINY_PRESETS)
PROMPT = encode("Hybrid!")  # 7 tokens: boundaries below and above K-1 = 3


@pytest.mark.parametrize("name", PRESETS)
def test_every_boundary_gives_the_same_tokens(name: str) -> None:
    model = cached_model(TINY_PRESETS[name])
    plain = model.generate(PROMPT, 6)
    assert len(plain) == 6
    for boundary in range(len(PROMPT) + 1):
        assert split_generate(model, PROMPT, 6, boundary) == plain, f"boundary {boundary}"


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("prompt_len", [1, 2, 3, 12])
def test_n_minus_1_protocol_equals_plain_run(name: str, prompt_len: int) -> None:
    spec = TINY_PRESETS[name]
    model = cached_model(spec)
    prompt = encode("The quick brown fox")[:prompt_len]
    prefill_store = model.new_store()
    computed = prefill_part(model, prompt, prefill_store)
    assert computed == prompt_len - 1
    sent = read_global_state(prefill_store, spec, computed)
    decode_store = model.new_store()  # a perfect transfer
    write_global_state(decode_store, sent)
    received = read_global_state(decode_store, spec, computed)
    assert received.equal(sent), "the state decode reads must be byte-equal to what prefill computed"
    tokens = decode_part(model, prompt[-1], computed, decode_store, 8)
    assert tokens == colocated_generate(spec, prompt, 8)


def test_a_wrong_decode_position_changes_tokens() -> None:
    """With RoPE, decoding the last prompt token at position N instead of N-1 must show."""
    model = cached_model(TINY_PRESETS["tiny-gdn"])
    prompt = encode("position matters")
    store = model.new_store()
    n = prefill_part(model, prompt, store)
    assert decode_part(model, prompt[-1], n + 1, store, 8) != model.generate(prompt, 8)


@pytest.mark.parametrize("name", PRESETS)
def test_two_instances_from_one_seed_agree_bit_for_bit(name: str) -> None:
    spec = TINY_PRESETS[name]
    a, b = ReferenceModel(spec, seed=11), ReferenceModel(spec, seed=11)
    sa, sb = a.new_store(), b.new_store()
    for pos, token in enumerate(encode("same bits")):
        assert torch.equal(a.step(token, pos, sa), b.step(token, pos, sb))
    assert read_global_state(sa, spec, 9).equal(read_global_state(sb, spec, 9))
    assert a.generate(PROMPT, 10) == b.generate(PROMPT, 10)
    assert ReferenceModel(spec, seed=12).generate(PROMPT, 10) != a.generate(PROMPT, 10)


class FakeStridedStore:
    """A fake standing in for a paged cache: it hands out strided and misaligned views (HND K/V,
    states at an odd element offset inside one flat buffer), which a real paged store may also do.
    The engine must compute the same bits as on the dense store."""

    def __init__(self, spec: ModelSpec) -> None:
        a = spec.attention
        self.kv = {i: torch.zeros(2, a.num_kv_heads, 256, a.head_dim) for i in spec.attention_layers}
        self.conv_shape, self.ssm_shape = conv_state_shape(spec), ssm_state_shape(spec)
        conv_n, ssm_n = math.prod(self.conv_shape), math.prod(self.ssm_shape)
        self.flat = {i: torch.zeros(1 + conv_n + ssm_n) for i in spec.ssm_layers}
        self.conv_n = conv_n

    def write_kv(self, layer: int, pos: int, k: Tensor, v: Tensor) -> None:
        self.kv[layer][0, :, pos] = k
        self.kv[layer][1, :, pos] = v

    def read_kv(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        buf = self.kv[layer][:, :, :length].permute(0, 2, 1, 3)  # [2, L, KV, hd], strided
        return buf[0], buf[1]

    def read_ssm(self, layer: int) -> tuple[Tensor, Tensor]:
        flat = self.flat[layer]
        conv = flat[1 : 1 + self.conv_n].view(self.conv_shape)
        return conv, flat[1 + self.conv_n :].view(self.ssm_shape)

    def write_ssm(self, layer: int, conv: Tensor, ssm: Tensor) -> None:
        self.flat[layer][1 : 1 + self.conv_n] = conv.reshape(-1)
        self.flat[layer][1 + self.conv_n :] = ssm.reshape(-1)


@pytest.mark.parametrize("name", PRESETS)
def test_strided_misaligned_store_gives_the_same_bits(name: str) -> None:
    spec = TINY_PRESETS[name]
    model = cached_model(spec)
    dense, strided = model.new_store(), FakeStridedStore(spec)
    for pos, token in enumerate(encode("strides!")):
        assert torch.equal(model.step(token, pos, dense), model.step(token, pos, strided))
    assert read_global_state(strided, spec, 8).equal(read_global_state(dense, spec, 8))


def _variant(pattern: str, rope: bool = True) -> ModelSpec:
    base = TINY_PRESETS["tiny-mamba2"]
    return dataclasses.replace(
        base,
        name=f"variant-{pattern}-{rope}",
        layer_kinds=pattern_to_kinds(pattern),
        attention=dataclasses.replace(base.attention, rope=rope),
    )


@pytest.mark.parametrize("spec", [_variant("PSMA"), _variant("SASSAS", rope=False)], ids=["parallel+mlp", "nope"])
def test_layer_variants_are_split_invariant(spec: ModelSpec) -> None:
    model = ReferenceModel(spec)
    plain = model.generate(PROMPT, 5)
    for boundary in (0, 1, len(PROMPT) - 1, len(PROMPT)):
        assert split_generate(model, PROMPT, 5, boundary) == plain
    if spec.attention.rope is False:
        assert plain != cached_model(TINY_PRESETS["tiny-mamba2"]).generate(PROMPT, 5)


def test_dense_store_grows_past_its_capacity() -> None:
    spec = TINY_PRESETS["tiny-mamba1"]
    model = cached_model(spec)
    small = DenseStateStore(spec, capacity=2)
    prompt = encode("longer than two")
    assert model.generate(prompt, 4, store=small) == model.generate(prompt, 4)


def test_bad_inputs_are_rejected() -> None:
    model = cached_model(TINY_PRESETS["tiny-mamba2"])
    with pytest.raises(ValueError):
        model.generate([], 3)
    with pytest.raises(ValueError):
        model.step(256, 0, model.new_store())
    with pytest.raises(ValueError):
        model.step(1, model.max_positions, model.new_store())
    with pytest.raises(ValueError, match="fp32"):
        ReferenceModel(TINY_PRESETS["tiny-mamba2"].with_dtypes(ssm="bf16"))
