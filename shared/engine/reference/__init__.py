"""The reference hybrid model engine: tiny seeded SSM + attention models for exactness tests.

Math in `model.py` (and one file per mixer family), state access through `state_store.py`,
the prefill/decode split in `boundary.py`, corruptions for negative controls in
`negative_controls.py`, the optional parallel (prefill-style) forms in `parallel_forms.py`.
"""

from __future__ import annotations

from shared.engine.reference.boundary import decode_part, num_prefill_tokens, prefill_part, split_generate
from shared.engine.reference.colocated import DEFAULT_SEED, cached_model, colocated_generate
from shared.engine.reference.model import ReferenceModel, greedy
from shared.engine.reference.negative_controls import (
    NEGATIVE_CONTROLS,
    Corruption,
    applicable_controls,
    generate_with_corruption,
)
from shared.engine.reference.numerics import configure_determinism
from shared.engine.reference.state_store import (
    DenseStateStore,
    GlobalState,
    StateStore,
    conv_sections,
    conv_state_shape,
    read_global_state,
    ssm_state_shape,
    write_global_state,
)
from shared.engine.reference.tokenizer import decode, encode
from shared.engine.reference.weights import generate_weights, model_fingerprint, weights_digest

__all__ = [
    "DEFAULT_SEED",
    "NEGATIVE_CONTROLS",
    "Corruption",
    "DenseStateStore",
    "GlobalState",
    "ReferenceModel",
    "StateStore",
    "applicable_controls",
    "cached_model",
    "colocated_generate",
    "configure_determinism",
    "conv_sections",
    "conv_state_shape",
    "decode",
    "decode_part",
    "encode",
    "generate_weights",
    "generate_with_corruption",
    "greedy",
    "model_fingerprint",
    "num_prefill_tokens",
    "prefill_part",
    "read_global_state",
    "split_generate",
    "ssm_state_shape",
    "weights_digest",
    "write_global_state",
]
