"""config.json parsing: every supported model type, legacy key names, dtype defaults, errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shared.layout.hf_config import SUPPORTED_MODEL_TYPES, parse_config, parse_dtype
from shared.layout.models import load_model
from shared.layout.presets import PRESETS, REAL_CONFIGS, TINY_PRESETS, get_preset
from shared.layout.spec import GDNDims, LayoutError, Mamba1Dims, Mamba2Dims

pytestmark = pytest.mark.timeout(60)
DATA = Path(__file__).parent / "data"


def same_model(a: object, b: object) -> bool:
    """Equal up to the name (a config file is named after its path)."""
    return dataclasses.replace(a, name="x") == dataclasses.replace(b, name="x")  # type: ignore[type-var]


@pytest.mark.parametrize(
    ("path", "preset"),
    [
        ("nemotron_h_nano.json", "nemotron-3-nano-30b-a3b"),
        ("nemotron_h_8b", "nemotron-h-8b"),  # directory holding config.json, new key names
        ("jamba_mini.json", "jamba-mini-1.7"),
        ("qwen3_next.json", "qwen3-next-80b-a3b"),
        ("qwen3_5.json", "qwen3.5-0.8b"),
        ("granitemoehybrid.json", "granite-4.0-h-tiny"),
        ("falcon_h1.json", "falcon-h1-1.5b"),
    ],
)
def test_sample_configs_parse_to_the_preset(path: str, preset: str) -> None:
    spec = load_model(str(DATA / path))
    assert same_model(spec, get_preset(preset))


def test_name_comes_from_the_config_content_never_the_directory(tmp_path: Path) -> None:
    assert load_model(str(DATA / "nemotron_h_8b")).name == "nvidia/Nemotron-H-8B-Base-8K"
    assert load_model(str(DATA / "jamba_mini.json")).name == "jamba"  # no _name_or_path: the model type
    # One config in two differently named directories: the same spec and fingerprint.
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((DATA / "jamba_mini.json").read_text())
    one, two = load_model(str(tmp_path / "one")), load_model(str(tmp_path / "two"))
    assert one == two and one.fingerprint() == two.fingerprint()


def test_qwen3_5_moe_and_its_text_config_parse_like_qwen3_5() -> None:
    wrapper = json.loads((DATA / "qwen3_5.json").read_text())
    dense = parse_config(wrapper, name="x")
    moe = parse_config(dict(wrapper, model_type="qwen3_5_moe"), name="x")
    text = parse_config(dict(wrapper["text_config"], model_type="qwen3_5_moe_text"), name="x")
    for spec in (moe, text):
        assert (spec.layer_kinds, spec.ssm, spec.attention) == (dense.layer_kinds, dense.ssm, dense.attention)
        assert (spec.kv_dtype, spec.conv_dtype, spec.ssm_dtype) == (dense.kv_dtype, dense.conv_dtype, dense.ssm_dtype)
    with pytest.raises(LayoutError, match="qwen3_5_moe config: missing key 'text_config'"):
        parse_config({"model_type": "qwen3_5_moe"}, name="x")


def test_bamba() -> None:
    spec = load_model(str(DATA / "bamba.json"))
    assert spec.model_type == "bamba" and spec.family == "mamba2"
    assert spec.attention_layers == (9, 18, 27) and len(spec.ssm_layers) == 29
    assert spec.ssm == Mamba2Dims(num_heads=128, head_dim=64, n_groups=1, d_state=128)
    assert spec.attention.head_dim == 128 and spec.attention.rope


def test_layer_kinds_and_dims() -> None:
    nano = get_preset("nemotron-3-nano-30b-a3b")
    assert nano.attention_layers == (5, 12, 19, 26, 33, 42)
    assert len(nano.ssm_layers) == 23 and nano.num_layers == 52
    assert get_preset("nemotron-h-8b").attention_layers == (7, 18, 29, 40)
    assert get_preset("jamba-reasoning-3b").attention_layers == (7, 21)
    assert get_preset("jamba-mini-1.7").attention_layers == (4, 12, 20, 28)
    assert get_preset("qwen3-next-80b-a3b").attention_layers == tuple(range(3, 48, 4))
    assert get_preset("qwen3.5-0.8b").attention_layers == (3, 7, 11, 15, 19, 23)
    falcon = get_preset("falcon-h1-7b")
    assert falcon.layer_kinds == ("parallel",) * 44
    assert falcon.attention_layers == falcon.ssm_layers == tuple(range(44))
    assert falcon.ssm == Mamba2Dims(num_heads=24, head_dim=128, n_groups=1, d_state=256)
    assert get_preset("jamba-reasoning-3b").ssm == Mamba1Dims(d_inner=5120, d_state=16, dt_rank=160)
    assert get_preset("qwen3-next-80b-a3b").ssm == GDNDims(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    assert not nano.attention.rope and get_preset("qwen3.5-0.8b").attention.rope


def test_vllm_dtype_defaults() -> None:
    # fp32 SSM state for Nemotron-H (also when the key is absent) and Qwen3.5; model dtype otherwise.
    assert get_preset("nemotron-3-nano-30b-a3b").ssm_dtype == "fp32"
    assert load_model(str(DATA / "nemotron_h_8b")).ssm_dtype == "fp32"
    assert get_preset("qwen3.5-0.8b").ssm_dtype == "fp32"
    for name in ("jamba-mini-1.7", "qwen3-next-80b-a3b", "granite-4.0-h-tiny", "falcon-h1-1.5b"):
        spec = get_preset(name)
        assert (spec.kv_dtype, spec.conv_dtype, spec.ssm_dtype) == ("bf16", "bf16", "bf16"), name
    for name, spec in TINY_PRESETS.items():
        assert (spec.kv_dtype, spec.conv_dtype, spec.ssm_dtype) == ("fp32", "fp32", "fp32"), name


def test_dtype_overrides() -> None:
    spec = load_model("nemotron-3-nano-30b-a3b", kv_dtype="fp8", ssm_dtype="bfloat16")
    assert (spec.kv_dtype, spec.conv_dtype, spec.ssm_dtype) == ("fp8", "bf16", "bf16")
    spec = load_model(str(DATA / "qwen3_5.json"), conv_dtype="fp32")
    assert spec.conv_dtype == "fp32"
    assert parse_dtype("torch.float16") == "fp16"
    with pytest.raises(LayoutError, match="int4"):
        parse_dtype("int4")
    # A float32 checkpoint is served in bf16, as vLLM's "auto" does.
    cfg = dict(REAL_CONFIGS["jamba-mini-1.7"], torch_dtype="float32")
    assert parse_config(cfg, name="x").kv_dtype == "bf16"


def test_presets_are_parsed_from_their_configs_and_tiny_presets_unchanged() -> None:
    for name, cfg in REAL_CONFIGS.items():
        assert parse_config(cfg, name=name) == PRESETS[name]
    assert set(PRESETS) == set(TINY_PRESETS) | set(REAL_CONFIGS)
    assert len(PRESETS) == 15
    tiny = TINY_PRESETS["tiny-mamba2"]
    assert tiny.layer_kinds == ("ssm", "attention", "ssm", "ssm", "attention", "ssm")
    assert tiny.ssm == Mamba2Dims(num_heads=16, head_dim=6, n_groups=8, d_state=10)


@pytest.mark.parametrize(
    ("model", "drop", "named"),
    [
        ("nemotron-h-8b", "mamba_num_heads", "mamba_num_heads"),
        ("nemotron-h-8b", "n_groups", "'n_groups' or 'mamba_n_groups'"),
        ("nemotron-h-8b", "hybrid_override_pattern", "hybrid_override_pattern"),
        ("jamba-mini-1.7", "mamba_d_state", "mamba_d_state"),
        ("jamba-mini-1.7", "attn_layer_period", "attn_layer_period"),
        ("qwen3-next-80b-a3b", "linear_num_value_heads", "linear_num_value_heads"),
        ("granite-4.0-h-tiny", "mamba_n_groups", "mamba_n_groups"),
        ("falcon-h1-7b", "num_hidden_layers", "num_hidden_layers"),
        ("jamba-reasoning-3b", "num_attention_heads", "num_attention_heads"),
    ],
)
def test_missing_key_is_named(model: str, drop: str, named: str) -> None:
    cfg = {k: v for k, v in REAL_CONFIGS[model].items() if k != drop}
    with pytest.raises(LayoutError, match=named):
        parse_config(cfg, name="x")


def test_qwen3_5_needs_text_config() -> None:
    with pytest.raises(LayoutError, match="text_config"):
        parse_config({"model_type": "qwen3_5"}, name="x")


def test_unsupported_model_type_and_bad_values() -> None:
    with pytest.raises(LayoutError, match="'llama' is not supported"):
        parse_config({"model_type": "llama"}, name="x")
    with pytest.raises(LayoutError, match="model_type"):
        parse_config({}, name="x")
    bad = dict(REAL_CONFIGS["nemotron-h-8b"], hybrid_override_pattern="M*Z")
    with pytest.raises(LayoutError, match="unknown letters"):
        parse_config(bad, name="x")
    bad = dict(REAL_CONFIGS["granite-4.0-h-tiny"], layer_types=["mamba", "conv"])
    with pytest.raises(LayoutError, match="'conv'"):
        parse_config(bad, name="x")
    bad = dict(REAL_CONFIGS["granite-4.0-h-tiny"], layer_types=["mamba"] * 40)
    with pytest.raises(LayoutError, match="no attention layer"):
        parse_config(bad, name="x")
    bad = dict(REAL_CONFIGS["jamba-mini-1.7"], mamba_d_state=0)
    with pytest.raises(LayoutError, match="mamba_d_state"):
        parse_config(bad, name="x")
    assert set(SUPPORTED_MODEL_TYPES) == {
        "nemotron_h",
        "jamba",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
        "granitemoehybrid",
        "falcon_h1",
        "bamba",
    }


def test_load_model_errors(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="neither a preset"):
        load_model("no-such-model")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LayoutError, match="cannot read"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(LayoutError, match="JSON object"):
        load_model(str(tmp_path))
