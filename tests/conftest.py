"""Suite-wide options: markers by directory; slow sweeps run only when asked for; in CI
(`HYBRID_PD_CI=1`, set by .ci/run) a test skipped for anything but the allowed reasons fails."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from shared.runtime import faults
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


# In CI every test runs except slow sweeps, GPU tests, and tests whose condition is a property of
# the machine no package provides (CUDA; the kernel's transparent huge pages mode). A test skipped
# for anything else (a missing tool, say) fails there, naming the reason, so .ci/run provides it.
CI_ALLOWED_MARKERS = ("slow", "gpu")
CI_ALLOWED_REASONS = ("CUDA", "transparent huge pages")


def in_ci() -> bool:
    return os.environ.get("HYBRID_PD_CI") == "1"


def skip_allowed_in_ci(item: pytest.Item, reason: str) -> bool:
    return any(m in item.keywords for m in CI_ALLOWED_MARKERS) or any(r in reason for r in CI_ALLOWED_REASONS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if not skip_allowed_in_ci(item, reason):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, where every test must run (.ci/run provides what tests need): {reason}"
    return report


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


@pytest.fixture
def inject_faults() -> Iterator[Callable[[faults.Injector], None]]:
    """Install a fault injector in this process (shared/runtime/faults.py) for one test."""
    before = faults.active()
    yield faults.install
    faults.install(before)
