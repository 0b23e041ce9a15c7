"""Which checkpoint families the paged engine computes (torch-free: the settings read it to pick
the default engine for a checkpoint directory)."""

from __future__ import annotations

import json
import os

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


def checkpoint_family(directory: str) -> str | None:
    """config.json's model_type of a checkpoint directory (None where it cannot be read)."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    family = config.get("model_type") if isinstance(config, dict) else None
    return family if isinstance(family, str) else None


def paged_serves(directory: str) -> bool:
    """Whether the paged engine computes the checkpoint in `directory`."""
    return checkpoint_family(directory) in PAGED_FAMILIES
