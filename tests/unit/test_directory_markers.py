"""tests/conftest.py marks every test by its top directory under tests/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TESTS_ROOT, directory_marker


def test_this_test_carries_the_unit_marker(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("integration") is None
    assert request.node.get_closest_marker("faults") is None


@pytest.mark.parametrize(
    ("relative", "expected"),
    [
        ("unit/layout/test_x.py", "unit"),
        ("integration/services/test_x.py", "integration"),
        ("faults/test_x.py", "faults"),
        ("conftest.py", None),  # a file directly under tests/ has no kind
    ],
)
def test_the_top_directory_decides(relative: str, expected: str | None) -> None:
    assert directory_marker(TESTS_ROOT / relative) == expected


def test_files_outside_tests_get_no_marker(tmp_path: Path) -> None:
    assert directory_marker(tmp_path / "unit" / "test_x.py") is None
