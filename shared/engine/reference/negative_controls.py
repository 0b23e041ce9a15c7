"""Corruptions that mimic a broken transfer, for proving that an exactness check can fail.

Each control edits a request's state in any `StateStore` between the prefill part and the decode
part of the N-1 protocol. Every one must change the generated tokens of typical prompts (N >= 2;
with N == 1 the prefilled state is all zeros, and only `replay_last_prompt_token` has an effect).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shared.engine.reference.boundary import decode_part, prefill_part
from shared.engine.reference.model import ReferenceModel
from shared.engine.reference.state_store import StateStore, conv_sections
from shared.layout.spec import Mamba2Dims

Corruption = Callable[[ReferenceModel, StateStore, Sequence[int]], None]


def zero_ssm_state(model: ReferenceModel, store: StateStore, prompt: Sequence[int]) -> None:
    """The SSM (temporal) state never arrived: zeros in every SSM layer."""
    for layer in model.spec.ssm_layers:
        conv, ssm = store.read_ssm(layer)
        store.write_ssm(layer, conv, torch.zeros_like(ssm))


def swap_conv_sections(model: ReferenceModel, store: StateStore, prompt: Sequence[int]) -> None:
    """Two equal-sized conv sections exchanged: B and C (Mamba2), q and k (GDN), as a wrong
    section offset would do. Mamba1 has a single section: not applicable (ValueError)."""
    sections = conv_sections(model.spec)
    if len(sections) < 3:
        raise ValueError(f"{model.spec.name}: the conv state has one section; nothing to swap")
    starts = [0]
    for _, size in sections:
        starts.append(starts[-1] + size)
    # Mamba2 [x|B|C] swaps sections 1 and 2; GDN [q|k|v] swaps sections 0 and 1.
    a, b = (1, 2) if sections[0][0] == "x" else (0, 1)
    for layer in model.spec.ssm_layers:
        conv, ssm = store.read_ssm(layer)
        swapped = conv.clone()
        swapped[starts[a] : starts[a + 1]] = conv[starts[b] : starts[b + 1]]
        swapped[starts[b] : starts[b + 1]] = conv[starts[a] : starts[a + 1]]
        store.write_ssm(layer, swapped, ssm)


def swap_groups(model: ReferenceModel, store: StateStore, prompt: Sequence[int]) -> None:
    """Mamba2 groups 0 and 1 exchanged in B and C, as reading the replica of the wrong group
    would do. Needs a Mamba2 model with n_groups >= 2 (ValueError otherwise)."""
    ssm = model.spec.ssm
    if not isinstance(ssm, Mamba2Dims) or ssm.n_groups < 2:
        raise ValueError(f"{model.spec.name}: needs Mamba2 with two or more groups")
    n, i, bc = ssm.d_state, ssm.intermediate, ssm.n_groups * ssm.d_state
    for layer in model.spec.ssm_layers:
        conv, state = store.read_ssm(layer)
        swapped = conv.clone()
        for start in (i, i + bc):  # B, then C
            swapped[start : start + n] = conv[start + n : start + 2 * n]
            swapped[start + n : start + 2 * n] = conv[start : start + n]
        store.write_ssm(layer, swapped, state)


def shift_conv_window(model: ReferenceModel, store: StateStore, prompt: Sequence[int]) -> None:
    """The conv window one token stale: time slots move one towards the newest end (index K-2),
    the newest input is lost and the oldest slot becomes zero."""
    for layer in model.spec.ssm_layers:
        conv, ssm = store.read_ssm(layer)
        shifted = torch.zeros_like(conv)
        shifted[:, 1:] = conv[:, :-1]
        store.write_ssm(layer, shifted, ssm)


def shift_conv_rows(model: ReferenceModel, store: StateStore, prompt: Sequence[int]) -> None:
    """A DS conv block read one row (one channel) off: channel c receives channel c+1's window."""
    for layer in model.spec.ssm_layers:
        conv, ssm = store.read_ssm(layer)
        store.write_ssm(layer, torch.roll(conv, shifts=-1, dims=0), ssm)


def replay_last_prompt_token(model: ReferenceModel, store: StateStore, prompt: Sequence[int]) -> None:
    """Boundary off by one: the prefill side also computes token N-1, so decode applies it twice."""
    model.step(prompt[-1], len(prompt) - 1, store)


NEGATIVE_CONTROLS: dict[str, Corruption] = {
    "zero_ssm_state": zero_ssm_state,
    "swap_conv_sections": swap_conv_sections,
    "swap_groups": swap_groups,
    "shift_conv_window": shift_conv_window,
    "shift_conv_rows": shift_conv_rows,
    "replay_last_prompt_token": replay_last_prompt_token,
}


def applicable_controls(model: ReferenceModel) -> dict[str, Corruption]:
    """The controls that make sense for this model's SSM family."""
    names = set(NEGATIVE_CONTROLS)
    if len(conv_sections(model.spec)) < 3:
        names.discard("swap_conv_sections")
    ssm = model.spec.ssm
    if not isinstance(ssm, Mamba2Dims) or ssm.n_groups < 2:
        names.discard("swap_groups")
    return {name: fn for name, fn in NEGATIVE_CONTROLS.items() if name in names}


def generate_with_corruption(model: ReferenceModel, prompt: Sequence[int], max_tokens: int, corruption: Corruption) -> list[int]:
    """The N-1 protocol in one process with `corruption` applied to the state in between."""
    store = model.new_store()
    n = prefill_part(model, prompt, store)
    corruption(model, store, prompt)
    return decode_part(model, prompt[-1], n, store, max_tokens)
