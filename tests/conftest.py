"""Suite-wide options: markers by directory; slow sweeps run only when asked for."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.sigterm import unwind_on_sigterm

# Tiny tensor ops on 2 cores: intra-op threads only add overhead, and one thread keeps every
# result independent of the machine's core count.
torch.set_num_threads(1)

TESTS_ROOT = Path(__file__).resolve().parent
# The first directory under tests/ decides a test's kind, so `-m unit` is the fast loop without
# anyone remembering to mark a file.
DIRECTORY_MARKERS = {"unit": "unit", "integration": "integration", "faults": "faults"}


def pytest_configure(config: pytest.Config) -> None:
    unwind_on_sigterm()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: it must see the directory markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = directory_marker(item.path)
        if marker is not None:
            item.add_marker(marker)
    if config.getoption("--run-slow") or os.environ.get("HYBRID_PD_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or HYBRID_PD_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def directory_marker(path: Path) -> str | None:
    """The marker for a test file: its top directory under tests/ (None outside those)."""
    try:
        top = path.resolve().relative_to(TESTS_ROOT).parts[0]
    except (ValueError, IndexError):
        return None
    return DIRECTORY_MARKERS.get(top)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """`hf_checkpoint(family)`: the directory of that family's tiny seeded checkpoint, built
    (save_pretrained, with tokenizer and generation config) the first time a test asks for it."""
    from shared.engine.hf.tiny_checkpoints import build_checkpoint

    root = tmp_path_factory.mktemp("hf-checkpoints")
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = build_checkpoint(family, str(root / family))
        return built[family]

    return get
