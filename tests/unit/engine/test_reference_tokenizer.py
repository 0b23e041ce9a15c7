"""Byte-level tokenizer of the reference engine."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.engine.reference import decode, encode

pytestmark = pytest.mark.timeout(60)


@given(st.text())
def test_round_trip_any_text(text: str) -> None:
    ids = encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert decode(ids) == text


def test_ids_are_utf8_bytes() -> None:
    assert encode("Aé") == [0x41, 0xC3, 0xA9]
    assert encode("") == []


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert decode([0x41, 0xFF, 0x42]) == "A\ufffdB"


def test_out_of_range_ids_are_rejected() -> None:
    with pytest.raises(ValueError):
        decode([256])
