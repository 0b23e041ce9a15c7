"""Seeded weights, fingerprints and state shapes of the reference engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine.reference import (
    ReferenceModel,
    conv_sections,
    conv_state_shape,
    generate_weights,
    model_fingerprint,
    ssm_state_shape,
    weights_digest,
)
from shared.layout.presets import TINY_PRESETS

pytestmark = pytest.mark.timeout(60)
PRESETS = sorted(TINY_PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_same_seed_gives_identical_weights(name: str) -> None:
    spec = TINY_PRESETS[name]
    a, b = generate_weights(spec, 7), generate_weights(spec, 7)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert weights_digest(a) == weights_digest(b)


@pytest.mark.parametrize("name", PRESETS)
def test_different_seed_gives_different_weights(name: str) -> None:
    spec = TINY_PRESETS[name]
    a, b = generate_weights(spec, 0), generate_weights(spec, 1)
    random_params = [k for k in a if not torch.equal(a[k], a[k].flatten()[0].expand_as(a[k]))]
    assert random_params, "some parameters must be random"
    assert all(not torch.equal(a[k], b[k]) for k in random_params)
    assert weights_digest(a) != weights_digest(b)


def test_weights_are_fp32_and_contiguous() -> None:
    for t in generate_weights(TINY_PRESETS["tiny-gdn"], 0).values():
        assert t.dtype == torch.float32 and t.is_contiguous()


def test_fingerprint_names_spec_and_seed() -> None:
    spec = TINY_PRESETS["tiny-mamba2"]
    assert model_fingerprint(spec, 0) == model_fingerprint(spec, 0)
    assert model_fingerprint(spec, 0) != model_fingerprint(spec, 1)
    assert model_fingerprint(spec, 0) != model_fingerprint(TINY_PRESETS["tiny-mamba2-g1"], 0)
    nope = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, rope=False))
    assert model_fingerprint(spec, 0) != model_fingerprint(nope, 0)
    assert ReferenceModel(spec, seed=3).fingerprint == model_fingerprint(spec, 3)


# hybrid-models.md 3.2: the global (TP = 1) per-layer state shapes of the tiny presets.
EXPECTED_STATE = {
    "tiny-mamba2": ((256, 3), (("x", 96), ("B", 80), ("C", 80)), (16, 6, 10)),
    "tiny-mamba2-g1": ((116, 3), (("x", 96), ("B", 10), ("C", 10)), (16, 6, 10)),
    "tiny-mamba2-g2": ((136, 3), (("x", 96), ("B", 20), ("C", 20)), (16, 6, 10)),
    "tiny-gdn": ((352, 3), (("q", 96), ("k", 96), ("v", 160)), (16, 10, 12)),
    "tiny-mamba1": ((96, 3), (("x", 96),), (96, 8)),
}


@pytest.mark.parametrize("name", PRESETS)
def test_state_shapes_match_the_design(name: str) -> None:
    spec = TINY_PRESETS[name]
    conv, sections, ssm = EXPECTED_STATE[name]
    assert conv_state_shape(spec) == conv
    assert conv_sections(spec) == sections
    assert ssm_state_shape(spec) == ssm
    store = ReferenceModel(spec).new_store()
    for layer in spec.ssm_layers:
        c, s = store.read_ssm(layer)
        assert tuple(c.shape) == conv and tuple(s.shape) == ssm
        assert not c.any() and not s.any()
