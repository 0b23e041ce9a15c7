"""A model by name or path: a preset, a config.json, or a directory holding one -> `ModelSpec`.

Above both hf_config (config.json parsing) and presets (which are parsed with it), so neither
of those imports the other back.
"""

from __future__ import annotations

import json
import os

from shared.layout.hf_config import parse_config, parse_dtype
from shared.layout.presets import PRESETS
from shared.layout.spec import LayoutError, ModelSpec


def load_model(
    name_or_path: str,
    *,
    kv_dtype: str | None = None,
    conv_dtype: str | None = None,
    ssm_dtype: str | None = None,
) -> ModelSpec:
    """A preset name, a config.json path, or a directory holding config.json -> `ModelSpec`."""
    if name_or_path in PRESETS:
        spec = PRESETS[name_or_path]
        return spec.with_dtypes(
            kv=parse_dtype(kv_dtype, what="kv dtype") if kv_dtype else None,
            conv=parse_dtype(conv_dtype, what="conv dtype") if conv_dtype else None,
            ssm=parse_dtype(ssm_dtype, what="ssm dtype") if ssm_dtype else None,
        )
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        if os.path.isdir(name_or_path):
            raise LayoutError(f"{path} does not exist: a checkpoint directory needs its config.json")
        if os.sep in name_or_path or name_or_path.endswith(".json"):
            raise LayoutError(f"{name_or_path} does not exist")
        raise LayoutError(f"model {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a config.json path")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LayoutError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LayoutError(f"{path}: a config.json must hold a JSON object")
    # The name comes from the config's content, never from where the file lies: one checkpoint
    # in two differently named directories is the same model (and must pair at handshake).
    name = cfg.get("_name_or_path") or cfg.get("model_type") or "model"
    return parse_config(cfg, name=str(name), kv_dtype=kv_dtype, conv_dtype=conv_dtype, ssm_dtype=ssm_dtype)
