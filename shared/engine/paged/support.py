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


# RoPE types whose frequencies the config fixes: the paged engine computes them with
# transformers' own initialisation (families.py `_rope`).
PAGED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
# RoPE types whose frequencies transformers changes with the running sequence length (the
# longest position of the current forward, and for dynamic NTK the longest one it has seen in
# any request): no per-request computation gives its bits, so these stay on the hf engine.
SEQUENCE_DEPENDENT_ROPE_TYPES: dict[str, str] = {
    "dynamic": "dynamic NTK scaling, whose frequencies follow the longest sequence length the model has run",
    "longrope": "LongRoPE, whose short or long factors are chosen by the sequence length each forward reaches",
}


def rope_type(rope: dict[str, Any]) -> str:
    """The rope_type of a config's rope_parameters / rope_scaling ("type" in older configs)."""
    return str(rope.get("rope_type", rope.get("type")) or "default")


def unsupported_feature(config: dict[str, Any]) -> str | None:
    """What in a config.json of a paged family the engine does not compute (None: nothing):
    RoPE whose frequencies depend on the running sequence length, or a rope type it lacks."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if not isinstance(rope, dict):
            continue
        kind = rope_type(rope)
        if kind in SEQUENCE_DEPENDENT_ROPE_TYPES:
            return f"{key} rope_type {kind!r} ({SEQUENCE_DEPENDENT_ROPE_TYPES[kind]})"
        if kind not in PAGED_ROPE_TYPES:
            return f"{key} rope_type {kind!r} (the paged engine computes {', '.join(PAGED_ROPE_TYPES)})"
    return None


def paged_serves(directory: str) -> bool:
    """Whether the paged engine computes the checkpoint in `directory` (else the hf engine does)."""
    config = _config(directory)
    return config is not None and config.get("model_type") in PAGED_FAMILIES and unsupported_feature(config) is None
