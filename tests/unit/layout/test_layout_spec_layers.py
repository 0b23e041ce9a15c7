"""ModelSpec's layer index tuples are cached per spec: a changed spec (replace) gets its own."""

from __future__ import annotations

from dataclasses import replace

from shared.layout.boundary import num_prefill_tokens
from shared.layout.presets import get_preset


def test_layer_indices_follow_the_specs_own_layer_kinds() -> None:
    spec = get_preset("tiny-mamba2")
    kinds = spec.layer_kinds
    assert spec.ssm_layers == tuple(i for i, k in enumerate(kinds) if k in ("ssm", "parallel")) != ()
    assert spec.attention_layers == tuple(i for i, k in enumerate(kinds) if k in ("attention", "parallel"))
    assert spec.ssm_layers is spec.ssm_layers  # computed once
    # Asked before: a spec made from it with other layers still answers for its own layers.
    attention_only = replace(spec, layer_kinds=("attention",) * len(kinds))
    assert attention_only.ssm_layers == () and attention_only.attention_layers == tuple(range(len(kinds)))
    assert num_prefill_tokens(spec, 8) == 7 and num_prefill_tokens(attention_only, 8) == 8
    assert attention_only == replace(spec, layer_kinds=("attention",) * len(kinds))  # equality: the fields alone
