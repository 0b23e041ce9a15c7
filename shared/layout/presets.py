"""Named model presets: real published configurations and the tiny seeded reference models."""

from __future__ import annotations

from shared.layout.hf_config import parse_config
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
    # Two groups: TP 4 and 8 replicate each group's B/C on 2 and 4 ranks (Nemotron-H at TP 16).
    "tiny-mamba2-g2": _tiny("tiny-mamba2-g2", Mamba2Dims(num_heads=16, head_dim=6, n_groups=2, d_state=10)),
    "tiny-gdn": _tiny("tiny-gdn", GDNDims(num_k_heads=8, num_v_heads=16, head_k_dim=12, head_v_dim=10)),
    "tiny-mamba1": _tiny("tiny-mamba1", Mamba1Dims(d_inner=96, d_state=8, dt_rank=8)),
}


# Published configurations (hybrid-models.md section 2.1), written as the config.json keys
# the real checkpoints carry so that presets and config files go through one parser. Only the
# keys that shape the cache (and a few for the reference math) are listed.
def _every(n: int, first: int, period: int) -> list[str]:
    return ["attention" if i >= first and (i - first) % period == 0 else "mamba" for i in range(n)]


def _qwen_layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


REAL_CONFIGS: dict[str, dict[str, object]] = {
    "nemotron-3-nano-30b-a3b": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "hidden_size": 2688,
        "vocab_size": 131072,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "mamba_ssm_cache_dtype": "float32",
        "moe_intermediate_size": 1856,
        "torch_dtype": "bfloat16",
    },
    "nemotron-h-8b": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "hidden_size": 4096,
        "intermediate_size": 21504,
        "vocab_size": 131072,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "torch_dtype": "bfloat16",
    },
    "jamba-reasoning-3b": {
        "model_type": "jamba",
        "num_hidden_layers": 28,
        "attn_layer_offset": 7,
        "attn_layer_period": 14,
        "hidden_size": 2560,
        "intermediate_size": 8192,
        "vocab_size": 65536,
        "num_attention_heads": 20,
        "num_key_value_heads": 1,
        "mamba_expand": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_dt_rank": 160,
        "torch_dtype": "bfloat16",
    },
    "jamba-mini-1.7": {
        "model_type": "jamba",
        "num_hidden_layers": 32,
        "attn_layer_offset": 4,
        "attn_layer_period": 8,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "vocab_size": 65536,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "mamba_expand": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_dt_rank": 256,
        "torch_dtype": "bfloat16",
    },
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "vocab_size": 151936,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    },
    "qwen3.5-0.8b": {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "num_hidden_layers": 24,
            "layer_types": _qwen_layer_types(24),
            "hidden_size": 1024,
            "intermediate_size": 3584,
            "vocab_size": 248320,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
            "dtype": "bfloat16",
        },
    },
    "granite-4.0-h-tiny": {
        "model_type": "granitemoehybrid",
        "layer_types": _every(40, 5, 10),
        "hidden_size": 1536,
        "vocab_size": 100352,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "position_embedding_type": "nope",
        "torch_dtype": "bfloat16",
    },
    # The attention positions of -small are assumed equal to -tiny's (4 of 40 layers).
    "granite-4.0-h-small": {
        "model_type": "granitemoehybrid",
        "layer_types": _every(40, 5, 10),
        "hidden_size": 4096,
        "vocab_size": 100352,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "position_embedding_type": "nope",
        "torch_dtype": "bfloat16",
    },
    "falcon-h1-1.5b": {
        "model_type": "falcon_h1",
        "num_hidden_layers": 24,
        "hidden_size": 2048,
        "vocab_size": 65537,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_d_ssm": 3072,
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "torch_dtype": "bfloat16",
    },
    "falcon-h1-7b": {
        "model_type": "falcon_h1",
        "num_hidden_layers": 44,
        "hidden_size": 3072,
        "vocab_size": 130049,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_d_ssm": 3072,
        "mamba_n_heads": 24,
        "mamba_d_head": 128,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "torch_dtype": "bfloat16",
    },
}

REAL_PRESETS: dict[str, ModelSpec] = {name: parse_config(cfg, name=name) for name, cfg in REAL_CONFIGS.items()}

PRESETS: dict[str, ModelSpec] = dict(TINY_PRESETS) | REAL_PRESETS


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise LayoutError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
