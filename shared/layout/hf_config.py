"""Hugging Face `config.json` -> `ModelSpec`, for the hybrid families hybrid-pd supports.

Key names follow transformers' config classes, plus the legacy names that published
config.json files still carry (Nemotron-H's `hybrid_override_pattern`, `mamba_n_groups`,
`mamba_d_conv`; Qwen's `full_attention_interval`; Jamba's `attn_layer_period/offset`).
Every key that shapes the cached bytes is required: a missing one is a `LayoutError` naming
the key, never a silent default. Keys that only matter to the math (vocab, MLP width) and the
conv kernel width (4 in every published model, transformers' default) are optional.

State dtypes follow vLLM's defaults: KV and conv state in the model dtype (a float32
checkpoint is served in bf16, as vLLM's "auto" does), SSM state in the model dtype except
Nemotron-H (`mamba_ssm_cache_dtype`, float32 when absent) and Qwen3.5 (`mamba_ssm_dtype`,
float32 when absent).

`parse_config` is pure. `load_model` also accepts a path and reads that one JSON file: the
only file access in `shared.layout`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shared.layout.spec import (
    DTYPES,
    AttentionDims,
    DType,
    GDNDims,
    LayerKind,
    LayoutError,
    Mamba1Dims,
    Mamba2Dims,
    ModelSpec,
    SSMDims,
)

Config = Mapping[str, Any]

_DTYPE_NAMES: dict[str, DType] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}


def parse_dtype(value: str, *, what: str = "dtype") -> DType:
    """`"bfloat16"`, `"torch.bfloat16"`, `"bf16"` ... -> a `DType`."""
    key = str(value).lower().removeprefix("torch.")
    try:
        return _DTYPE_NAMES[key]
    except KeyError:
        raise LayoutError(f"{what} {value!r} is not supported; use one of {', '.join(DTYPES)}") from None


class _Reader:
    """Reads keys of one config dict; errors name the model type and the key."""

    def __init__(self, cfg: Config, model_type: str) -> None:
        self.cfg = cfg
        self.model_type = model_type

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def first(self, *keys: str) -> Any:
        for key in keys:
            if self.cfg.get(key) is not None:
                return self.cfg[key]
        names = " or ".join(repr(k) for k in keys)
        raise LayoutError(f"{self.model_type} config: missing key {names}")

    def get_int(self, *keys: str) -> int:
        value = self.first(*keys)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise LayoutError(f"{self.model_type} config: key {keys[0]!r} must be a positive integer, got {value!r}")
        return value

    def opt_int(self, key: str, default: int) -> int:
        return self.get_int(key) if self.has(key) else default

    def int_or_auto(self, key: str, auto: Callable[[], int]) -> int:
        """transformers' `"auto"` convention (head dims, dt_rank derived from other keys)."""
        if self.cfg.get(key, "auto") == "auto":
            return auto()
        return self.get_int(key)

    def head_dim(self) -> int:
        if self.has("head_dim"):
            return self.get_int("head_dim")
        if self.has("attention_head_dim"):
            return self.get_int("attention_head_dim")
        hidden, heads = self.get_int("hidden_size"), self.get_int("num_attention_heads")
        if hidden % heads:
            raise LayoutError(f"{self.model_type} config: missing key 'head_dim' and hidden_size % num_attention_heads != 0")
        return hidden // heads

    def attention(self, *, rope: bool) -> AttentionDims:
        heads = self.get_int("num_attention_heads")
        kv = self.get_int("num_key_value_heads") if self.has("num_key_value_heads") else heads
        return AttentionDims(num_heads=heads, num_kv_heads=kv, head_dim=self.head_dim(), rope=rope)

    def kinds_from_list(self, key: str, table: Mapping[str, LayerKind]) -> tuple[LayerKind, ...]:
        values = self.first(key)
        if not isinstance(values, Sequence) or isinstance(values, str):
            raise LayoutError(f"{self.model_type} config: key {key!r} must be a list of layer types")
        try:
            return tuple(table[str(v)] for v in values)
        except KeyError as e:
            raise LayoutError(
                f"{self.model_type} config: key {key!r} has unknown layer type {e.args[0]!r} (known: {', '.join(sorted(table))})"
            ) from None

    def model_dtype(self) -> DType:
        raw = self.cfg.get("dtype") or self.cfg.get("torch_dtype") or "bfloat16"
        dtype = parse_dtype(str(raw), what=f"{self.model_type} config: model dtype")
        return "bf16" if dtype == "fp32" else dtype  # vLLM "auto" serves float32 checkpoints in bf16


# Layer-type names of transformers' configs (new and legacy spellings).
_MAMBA_LIST: dict[str, LayerKind] = {
    "mamba": "ssm",
    "linear_attention": "ssm",
    "attention": "attention",
    "full_attention": "attention",
    "mlp": "mlp",
    "moe": "mlp",
}
_NEMOTRON_PATTERN: dict[str, LayerKind] = {"M": "ssm", "*": "attention", "-": "mlp", "E": "mlp"}


def _nemotron_h(r: _Reader) -> tuple[tuple[LayerKind, ...], AttentionDims, SSMDims, DType]:
    if r.has("layers_block_type") or r.has("layer_types"):
        key = "layers_block_type" if r.has("layers_block_type") else "layer_types"
        kinds = r.kinds_from_list(key, _MAMBA_LIST)
    else:
        pattern = str(r.first("hybrid_override_pattern"))
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise LayoutError(f"nemotron_h config: key 'hybrid_override_pattern' has unknown letters {bad} (known: M * - E)")
        kinds = tuple(_NEMOTRON_PATTERN[c] for c in pattern)
    ssm = Mamba2Dims(
        num_heads=r.get_int("mamba_num_heads"),
        head_dim=r.get_int("mamba_head_dim"),
        n_groups=r.get_int("n_groups", "mamba_n_groups"),
        d_state=r.get_int("ssm_state_size", "mamba_d_state"),
        conv_kernel=r.get_int("conv_kernel", "mamba_d_conv") if r.has("conv_kernel") or r.has("mamba_d_conv") else 4,
    )
    raw = r.cfg.get("mamba_ssm_cache_dtype") or "float32"  # vLLM's default when the key is absent
    ssm_dtype = parse_dtype(str(raw), what="nemotron_h mamba_ssm_cache_dtype")
    return kinds, r.attention(rope=False), ssm, ssm_dtype


def _jamba(r: _Reader) -> tuple[tuple[LayerKind, ...], AttentionDims, SSMDims, DType]:
    if r.has("layers_block_type"):
        kinds = r.kinds_from_list("layers_block_type", _MAMBA_LIST)
    else:
        n, period, offset = r.get_int("num_hidden_layers"), r.get_int("attn_layer_period"), r.first("attn_layer_offset")
        kinds = tuple("attention" if i % period == int(offset) else "ssm" for i in range(n))
    hidden = r.get_int("hidden_size")
    ssm = Mamba1Dims(
        d_inner=r.get_int("mamba_expand") * hidden,
        d_state=r.get_int("mamba_d_state"),
        dt_rank=r.int_or_auto("mamba_dt_rank", lambda: math.ceil(hidden / 16)),
        conv_kernel=r.opt_int("mamba_d_conv", 4),
    )
    return kinds, r.attention(rope=False), ssm, r.model_dtype()


def _qwen_gdn(r: _Reader, *, ssm_dtype_key: str | None) -> tuple[tuple[LayerKind, ...], AttentionDims, SSMDims, DType]:
    if r.has("layer_types"):
        kinds = r.kinds_from_list("layer_types", _MAMBA_LIST)
    else:
        n = r.get_int("num_hidden_layers")
        interval = r.opt_int("full_attention_interval", 4)  # transformers' default for both Qwen configs
        kinds = tuple("attention" if (i + 1) % interval == 0 else "ssm" for i in range(n))
    ssm = GDNDims(
        num_k_heads=r.get_int("linear_num_key_heads"),
        num_v_heads=r.get_int("linear_num_value_heads"),
        head_k_dim=r.get_int("linear_key_head_dim"),
        head_v_dim=r.get_int("linear_value_head_dim"),
        conv_kernel=r.opt_int("linear_conv_kernel_dim", 4),
    )
    if ssm_dtype_key is None:
        ssm_dtype = r.model_dtype()
    else:
        ssm_dtype = parse_dtype(str(r.cfg.get(ssm_dtype_key) or "float32"), what=f"{r.model_type} {ssm_dtype_key}")
    return kinds, r.attention(rope=True), ssm, ssm_dtype


def _mamba2_hf(r: _Reader, *, width: Callable[[], int]) -> Mamba2Dims:
    """Granite / Bamba / Falcon-H1 share `mamba_*` key names; `width` is only read for "auto" head dims."""
    heads = r.get_int("mamba_n_heads")

    def auto_head() -> int:
        intermediate = width()
        if intermediate % heads:
            raise LayoutError(f"{r.model_type} config: mamba_n_heads {heads} does not divide the mamba width {intermediate}")
        return intermediate // heads

    return Mamba2Dims(
        num_heads=heads,
        head_dim=r.int_or_auto("mamba_d_head", auto_head),
        n_groups=r.get_int("mamba_n_groups"),
        d_state=r.get_int("mamba_d_state"),
        conv_kernel=r.opt_int("mamba_d_conv", 4),
    )


def _granite(r: _Reader) -> tuple[tuple[LayerKind, ...], AttentionDims, SSMDims, DType]:
    key = "layer_types" if r.has("layer_types") else "layers_block_type"
    kinds = r.kinds_from_list(key, _MAMBA_LIST)
    ssm = _mamba2_hf(r, width=lambda: r.get_int("mamba_expand") * r.get_int("hidden_size"))
    rope = r.cfg.get("position_embedding_type") == "rope"
    return kinds, r.attention(rope=rope), ssm, r.model_dtype()


def _bamba(r: _Reader) -> tuple[tuple[LayerKind, ...], AttentionDims, SSMDims, DType]:
    n = r.get_int("num_hidden_layers")
    attn = r.first("attn_layer_indices")
    if not isinstance(attn, Sequence) or any(not isinstance(i, int) or not 0 <= i < n for i in attn):
        raise LayoutError(f"bamba config: key 'attn_layer_indices' must list layer indices in [0, {n})")
    attn_set = set(attn)
    kinds: tuple[LayerKind, ...] = tuple("attention" if i in attn_set else "ssm" for i in range(n))
    ssm = _mamba2_hf(r, width=lambda: r.get_int("mamba_expand") * r.get_int("hidden_size"))
    return kinds, r.attention(rope=True), ssm, r.model_dtype()


def _falcon_h1(r: _Reader) -> tuple[tuple[LayerKind, ...], AttentionDims, SSMDims, DType]:
    # Every Falcon-H1 layer runs attention and Mamba2 side by side: both caches per layer.
    parallel: LayerKind = "parallel"
    kinds = (parallel,) * r.get_int("num_hidden_layers")

    def width() -> int:
        if r.has("mamba_d_ssm"):
            return r.get_int("mamba_d_ssm")
        return r.get_int("mamba_expand") * r.get_int("hidden_size")

    return kinds, r.attention(rope=True), _mamba2_hf(r, width=width), r.model_dtype()


_PARSERS: dict[str, Callable[[_Reader], tuple[tuple[LayerKind, ...], AttentionDims, SSMDims, DType]]] = {
    "nemotron_h": _nemotron_h,
    "jamba": _jamba,
    "qwen3_next": lambda r: _qwen_gdn(r, ssm_dtype_key=None),
    "qwen3_5": lambda r: _qwen_gdn(r, ssm_dtype_key="mamba_ssm_dtype"),
    "qwen3_5_text": lambda r: _qwen_gdn(r, ssm_dtype_key="mamba_ssm_dtype"),
    # The MoE variants differ from qwen3_5 in their MLPs only; the cached state is the same.
    "qwen3_5_moe": lambda r: _qwen_gdn(r, ssm_dtype_key="mamba_ssm_dtype"),
    "qwen3_5_moe_text": lambda r: _qwen_gdn(r, ssm_dtype_key="mamba_ssm_dtype"),
    "granitemoehybrid": _granite,
    "falcon_h1": _falcon_h1,
    "bamba": _bamba,
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(set(_PARSERS) - {"qwen3_5_text", "qwen3_5_moe_text"}))
# Multimodal wrappers: the language model's keys live in `text_config`.
_WRAPPERS: tuple[str, ...] = ("qwen3_5", "qwen3_5_moe")


def parse_config(
    cfg: Config,
    *,
    name: str,
    kv_dtype: str | None = None,
    conv_dtype: str | None = None,
    ssm_dtype: str | None = None,
) -> ModelSpec:
    """A config.json dict -> `ModelSpec` (pure). Dtype overrides take vLLM's dtype names or ours."""
    model_type = cfg.get("model_type")
    if model_type is None:
        raise LayoutError("config: missing key 'model_type'")
    if model_type not in _PARSERS:
        raise LayoutError(f"config: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type in _WRAPPERS:
        # Multimodal wrapper: the language model lives in text_config; dtypes may sit on either level.
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise LayoutError(f"{model_type} config: missing key 'text_config'")
        merged = {k: v for k, v in cfg.items() if k in ("dtype", "torch_dtype", "mamba_ssm_dtype")} | dict(text)
        reader = _Reader(merged, str(model_type))
    else:
        reader = _Reader(cfg, str(model_type))
    kinds, attention, ssm, default_ssm = _PARSERS[str(model_type)](reader)
    if not any(k in ("attention", "parallel") for k in kinds):
        raise LayoutError(f"{model_type} config: no attention layer; hybrid-pd needs attention and SSM layers")
    if not any(k in ("ssm", "parallel") for k in kinds):
        raise LayoutError(f"{model_type} config: no SSM layer; hybrid-pd needs attention and SSM layers")
    model_dtype = reader.model_dtype()
    intermediate = reader.cfg.get("intermediate_size")
    spec = ModelSpec(
        name=name,
        model_type=str(model_type),
        layer_kinds=kinds,
        hidden_size=reader.get_int("hidden_size"),
        vocab_size=int(reader.cfg.get("vocab_size") or 0),
        attention=attention,
        ssm=ssm,
        kv_dtype=model_dtype,
        conv_dtype=model_dtype,
        ssm_dtype=default_ssm,
        intermediate_size=intermediate if isinstance(intermediate, int) else 0,
    )
    return spec.with_dtypes(
        kv=parse_dtype(kv_dtype, what="kv dtype") if kv_dtype else None,
        conv=parse_dtype(conv_dtype, what="conv dtype") if conv_dtype else None,
        ssm=parse_dtype(ssm_dtype, what="ssm dtype") if ssm_dtype else None,
    )
