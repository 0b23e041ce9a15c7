"""`variant_checkpoint(name)`: the tiny checkpoint of a tiny_checkpoints.VARIANTS entry (a family
with one config feature on top), built the first time a test of the session asks for it."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def variant_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    from shared.engine.hf.tiny_checkpoints import build_checkpoint, variant_family

    root = tmp_path_factory.mktemp("variant-checkpoints")
    built: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in built:
            built[variant] = build_checkpoint(variant_family(variant), str(root / variant), variant=variant)
        return built[variant]

    return get
