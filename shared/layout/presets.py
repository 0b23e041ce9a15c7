"""Named model presets: real published configurations and the tiny seeded reference models."""

from __future__ import annotations

from shared.layout.spec import (
    AttentionDims,
    GDNDims,
    LayerKind,
    LayoutError,
    Mamba1Dims,
    Mamba2Dims,
    ModelSpec,
)


def pattern_to_kinds(pattern: str) -> tuple[LayerKind, ...]:
    """`"SASSAS"` -> kinds; S = ssm, A = attention, P = parallel (both), M = mlp only."""
    table: dict[str, LayerKind] = {"S": "ssm", "A": "attention", "P": "parallel", "M": "mlp"}
    try:
        return tuple(table[c] for c in pattern.replace(" ", ""))
    except KeyError as e:
        raise LayoutError(f"layer pattern {pattern!r}: unknown layer letter {e.args[0]!r} (use S, A, P, M)") from None


# The tiny reference models (hybrid-models.md section 3.2). fp32 everywhere so that
# disaggregated decoding can be compared bit for bit with colocated decoding.
TINY_PATTERN = "SASSAS"
_TINY_ATTENTION = AttentionDims(num_heads=8, num_kv_heads=2, head_dim=16, rope=True)


def _tiny(name: str, ssm: Mamba2Dims | GDNDims | Mamba1Dims) -> ModelSpec:
    return ModelSpec(
        name=name,
        model_type="reference",
        layer_kinds=pattern_to_kinds(TINY_PATTERN),
        hidden_size=64,
        vocab_size=256,
        attention=_TINY_ATTENTION,
        ssm=ssm,
        kv_dtype="fp32",
        conv_dtype="fp32",
        ssm_dtype="fp32",
        intermediate_size=96,
    )


TINY_PRESETS: dict[str, ModelSpec] = {
    "tiny-mamba2": _tiny("tiny-mamba2", Mamba2Dims(num_heads=16, head_dim=6, n_groups=8, d_state=10)),
    "tiny-mamba2-g1": _tiny("tiny-mamba2-g1", Mamba2Dims(num_heads=16, head_dim=6, n_groups=1, d_state=10)),
    "tiny-gdn": _tiny("tiny-gdn", GDNDims(num_k_heads=8, num_v_heads=16, head_k_dim=12, head_v_dim=10)),
    "tiny-mamba1": _tiny("tiny-mamba1", Mamba1Dims(d_inner=96, d_state=8, dt_rank=8)),
}

PRESETS: dict[str, ModelSpec] = dict(TINY_PRESETS)


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise LayoutError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
