"""Seeded random weights for a `ModelSpec`, and the fingerprint both services compare.

All parameters are drawn on CPU, fp32, from one `torch.Generator().manual_seed(seed)` in
sorted-name order, then moved to the device: every process and device holds the same bits.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from shared.engine.reference.attention import attention_params
from shared.engine.reference.gdn import gdn_params
from shared.engine.reference.initializers import ParamSpec, constant, linear, normal
from shared.engine.reference.mamba1 import mamba1_params
from shared.engine.reference.mamba2 import mamba2_params
from shared.layout.spec import GDNDims, Mamba1Dims, Mamba2Dims, ModelSpec

# Bump when the parameter set or any init changes: the fingerprint must then change too.
WEIGHTS_VERSION = "reference-weights-v1"
EMBED_STD = 1.0
# argmax ignores the scale; this keeps logit gaps well above fp32 rounding for tolerance checks.
LM_HEAD_GAIN = 4.0


def ssm_params(spec: ModelSpec) -> dict[str, ParamSpec]:
    d, hidden = spec.ssm, spec.hidden_size
    if isinstance(d, Mamba2Dims):
        return mamba2_params(d, hidden)
    if isinstance(d, GDNDims):
        return gdn_params(d, hidden)
    assert isinstance(d, Mamba1Dims)
    return mamba1_params(d, hidden)


def mlp_params(hidden: int, intermediate: int) -> dict[str, ParamSpec]:
    return {
        "w_gate_up": ParamSpec((2 * intermediate, hidden), linear(hidden)),  # [gate | up]
        "w_down": ParamSpec((hidden, intermediate), linear(intermediate)),
    }


def layer_prefix(layer: int) -> str:
    return f"layers.{layer:03d}."


def model_params(spec: ModelSpec) -> dict[str, ParamSpec]:
    """Every parameter of the model, by name."""
    if spec.intermediate_size <= 0:
        raise ValueError(f"{spec.name}: the reference engine needs intermediate_size > 0 (MLP width)")
    hidden = spec.hidden_size
    params: dict[str, ParamSpec] = {
        "embed": ParamSpec((spec.vocab_size, hidden), normal(EMBED_STD)),
        "final_norm": ParamSpec((hidden,), constant(1.0)),
        "lm_head": ParamSpec((spec.vocab_size, hidden), linear(hidden, LM_HEAD_GAIN)),
    }
    for i, kind in enumerate(spec.layer_kinds):
        pre = layer_prefix(i)
        parts: dict[str, dict[str, ParamSpec]] = {"mlp.": mlp_params(hidden, spec.intermediate_size)}
        if kind in ("attention", "parallel"):
            parts["attn."] = attention_params(spec.attention, hidden)
        if kind in ("ssm", "parallel"):
            parts["ssm."] = ssm_params(spec)
        if kind != "mlp":
            params[pre + "norm_mixer"] = ParamSpec((hidden,), constant(1.0))
        params[pre + "norm_mlp"] = ParamSpec((hidden,), constant(1.0))
        for part, table in parts.items():
            params.update({pre + part + name: p for name, p in table.items()})
    return params


def generate_weights(spec: ModelSpec, seed: int) -> dict[str, Tensor]:
    """Draw all parameters on CPU in sorted-name order (device-independent bits)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    params = model_params(spec)
    return {name: params[name].init(gen, params[name].shape).contiguous() for name in sorted(params)}


def model_fingerprint(spec: ModelSpec, seed: int) -> str:
    """SHA-256 naming these exact weights: the spec's fingerprint, the seed, the init version."""
    blob = f"{WEIGHTS_VERSION}|{spec.fingerprint()}|seed={seed}"
    return hashlib.sha256(blob.encode()).hexdigest()


def weights_digest(weights: dict[str, Tensor]) -> str:
    """SHA-256 over the weight bytes themselves (tests; catches an init that drifted)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
