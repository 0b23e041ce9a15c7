"""Which checkpoint families the paged engine computes (torch-free: the settings read it to pick
the default engine for a checkpoint directory)."""

from __future__ import annotations

import json
import os
from typing import Any

ALL_HYBRID_FAMILIES: tuple[str, ...] = (
    "nemotron_h",
    "bamba",
    "granitemoehybrid",
    "falcon_h1",
    "jamba",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
)
# The families families.py builds (a test keeps the two lists equal).
PAGED_FAMILIES: tuple[str, ...] = ALL_HYBRID_FAMILIES


def _config(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def checkpoint_family(directory: str) -> str | None:
    """config.json's model_type of a checkpoint directory (None where it cannot be read)."""
    config = _config(directory)
    family = config.get("model_type") if config is not None else None
    return family if isinstance(family, str) else None


def unsupported_feature(config: dict[str, Any]) -> str | None:
    """What in a config.json of a paged family the engine does not compute (None: nothing):
    Nemotron-H's routed-expert layers, RoPE other than the default."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    kinds = text.get("layers_block_type") or []
    pattern = text.get("hybrid_override_pattern") or ""
    if "moe" in kinds or "E" in str(pattern):
        return "Nemotron-H mixture-of-experts layers"
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            return f"rope_type {rope.get('rope_type', rope.get('type'))!r}"
    return None


def paged_serves(directory: str) -> bool:
    """Whether the paged engine computes the checkpoint in `directory` (else the hf engine does)."""
    config = _config(directory)
    return config is not None and config.get("model_type") in PAGED_FAMILIES and unsupported_feature(config) is None
