"""The parallel (prefill-kernel style) forms agree with the canonical step loop within fp32
tolerance: logits of every position and the final state. Never compared by tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine.reference import ReferenceModel, cached_model, encode, read_global_state
from shared.engine.reference.parallel_forms import parallel_prefill
from shared.layout.presets import TINY_PRESETS, pattern_to_kinds
from shared.layout.spec import ModelSpec

pytestmark = pytest.mark.timeout(120)
TEXT = encode("Chunked forms must agree with the loop!")


def _check(model: ReferenceModel, length: int) -> None:
    spec, tokens = model.spec, TEXT[:length]
    store = model.new_store()
    loop_logits = torch.stack([model.step(t, pos, store) for pos, t in enumerate(tokens)])
    loop_state = read_global_state(store, spec, length)
    par_logits, par_state = parallel_prefill(model, tokens)
    torch.testing.assert_close(par_logits, loop_logits, rtol=1e-4, atol=2e-4)
    for layer in spec.attention_layers:
        for a, b in zip(par_state.kv[layer], loop_state.kv[layer]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
    for layer in spec.ssm_layers:
        for a, b in zip(par_state.ssm[layer], loop_state.ssm[layer]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
@pytest.mark.parametrize("length", [1, 2, 8, 19])  # chunk size 8: one chunk, exact fit, several
def test_parallel_forms_match_the_step_loop(name: str, length: int) -> None:
    _check(cached_model(TINY_PRESETS[name]), length)


def test_parallel_layers_match_too() -> None:
    base: ModelSpec = TINY_PRESETS["tiny-gdn"]
    spec = dataclasses.replace(base, name="gdn-parallel", layer_kinds=pattern_to_kinds("PSMA"))
    _check(ReferenceModel(spec), 11)
