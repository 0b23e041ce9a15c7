"""The protocol version constant, the handshake message and the numbered history agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared.layout.page import build_engine_layout
from shared.layout.presets import get_preset
from shared.runtime.layout_message import RankMemory, engine_layout_message
from shared.runtime.protocol_version import PROTOCOL_VERSION

HISTORY = Path(__file__).resolve().parents[3] / "docs" / "protocol-versions.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|", re.M)


def history_versions(text: str) -> list[int]:
    return [int(m) for m in ROW.findall(text)]


def check_history(versions: list[int], current: int) -> None:
    assert versions == list(range(1, len(versions) + 1)), f"history rows not numbered 1, 2, ...: {versions}"
    assert versions[-1] == current, f"history ends at {versions[-1]}, PROTOCOL_VERSION is {current}: add a row"


def test_the_history_is_numbered_and_ends_at_the_current_version() -> None:
    check_history(history_versions(HISTORY.read_text(encoding="utf-8")), PROTOCOL_VERSION)


def test_negative_controls_a_missing_row_and_a_gap_are_caught() -> None:
    with pytest.raises(AssertionError, match="add a row"):
        check_history([1], 2)
    with pytest.raises(AssertionError, match="numbered"):
        check_history([1, 3], 3)


def test_the_handshake_message_carries_the_constant() -> None:
    layout = build_engine_layout(get_preset("tiny-mamba2"), 1)
    ranks = [RankMemory("a0", b"", "cpu", 0, tuple([1 << 30] * layout.num_regions))]
    msg = engine_layout_message(layout, role="prefill", engine_id="e", incarnation=1, num_logical_blocks=4, ranks=ranks)
    assert msg.protocol_version == PROTOCOL_VERSION
