"""Negative controls: each simulated transfer bug must change the generated tokens, so that an
exactness check built on this engine can fail."""

from __future__ import annotations

import pytest

from shared.engine.reference import (
    NEGATIVE_CONTROLS,
    applicable_controls,
    cached_model,
    encode,
    generate_with_corruption,
    read_global_state,
)
from shared.engine.reference.negative_controls import replay_last_prompt_token, swap_conv_sections, swap_groups
from shared.layout.presets import TINY_PRESETS

pytestmark = pytest.mark.timeout(120)
PRESETS = sorted(TINY_PRESETS)
TYPICAL_PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "abcdefgh", "P/D split"]
MAX_TOKENS = 16


@pytest.mark.parametrize("name", PRESETS)
def test_every_control_changes_the_tokens(name: str) -> None:
    model = cached_model(TINY_PRESETS[name])
    controls = applicable_controls(model)
    not_here = {"swap_conv_sections"} if name == "tiny-mamba1" else set()
    if name not in ("tiny-mamba2", "tiny-mamba2-g2"):  # the Mamba2 presets with several groups
        not_here.add("swap_groups")
    expected = set(NEGATIVE_CONTROLS) - not_here
    assert set(controls) == expected
    for text in TYPICAL_PROMPTS:
        prompt = encode(text)
        clean = model.generate(prompt, MAX_TOKENS)
        for control_name, corrupt in controls.items():
            broken = generate_with_corruption(model, prompt, MAX_TOKENS, corrupt)
            assert broken != clean, f"{control_name} did not change the tokens of {text!r}"


@pytest.mark.parametrize("name", PRESETS)
def test_every_control_changes_the_state(name: str) -> None:
    spec = TINY_PRESETS[name]
    model = cached_model(spec)
    prompt = encode("state bytes")
    for control_name, corrupt in applicable_controls(model).items():
        store = model.new_store()
        model.prefill(prompt[:-1], store)
        before = read_global_state(store, spec, len(prompt) - 1)
        corrupt(model, store, prompt)
        assert not read_global_state(store, spec, len(prompt) - 1).equal(before), control_name


@pytest.mark.parametrize("name", PRESETS)
def test_replaying_the_last_token_shows_even_for_one_token_prompts(name: str) -> None:
    model = cached_model(TINY_PRESETS[name])
    for prompt in (encode("A"), encode("Hi")):
        clean = model.generate(prompt, MAX_TOKENS)
        assert generate_with_corruption(model, prompt, MAX_TOKENS, replay_last_prompt_token) != clean


def test_swapping_groups_needs_two_groups() -> None:
    for name in ("tiny-mamba2-g1", "tiny-gdn"):
        model = cached_model(TINY_PRESETS[name])
        with pytest.raises(ValueError, match="two or more groups"):
            swap_groups(model, model.new_store(), encode("x"))


def test_swapping_sections_needs_two_equal_sections() -> None:
    model = cached_model(TINY_PRESETS["tiny-mamba1"])
    with pytest.raises(ValueError):
        swap_conv_sections(model, model.new_store(), encode("x"))
