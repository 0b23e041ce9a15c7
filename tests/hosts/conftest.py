"""Tests across namespace hosts: skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridpd_tools.bench.netns import why_unavailable

_REASON: list[str | None] = []


def namespaces_or_skip() -> None:
    if not _REASON:
        _REASON.append(why_unavailable())
    if _REASON[0] is not None:
        pytest.skip(f"hosts: {_REASON[0]}")


@pytest.fixture(autouse=True)
def _need_namespaces() -> Iterator[None]:
    namespaces_or_skip()
    yield
