"""Stop sequences over streamed text: cut before the first match, hold back possible prefixes."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from shared.http.stop import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.finish()
    return out, m.stopped


def test_stop_split_across_pieces_is_found_and_removed() -> None:
    assert run(["END"], ["abc E", "N", "Dxyz"]) == ("abc ", True)
    assert run(["\n\n", "##"], ["a\n", "b#", "#c"]) == ("a\nb", True)


def test_held_back_prefix_is_released_when_it_does_not_complete() -> None:
    m = StopMatcher(["END"])
    assert m.feed("abcEN") == "abc"  # "EN" might become END
    assert m.feed("x") == "ENx"
    assert m.finish() == "" and not m.stopped


def test_no_stops_passes_everything_at_once() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.finish() == "" and not m.stopped


def test_nothing_after_a_match() -> None:
    m = StopMatcher(["x"])
    assert m.feed("axb") == "a" and m.feed("more") == "" and m.finish() == ""


@given(
    text=st.text(alphabet="abcE\nND", max_size=40),
    stops=st.lists(st.text(alphabet="abcE\nND", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streaming_equals_cutting_the_whole_text(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run(stops, pieces) == reference(stops, text)


def reference(stops: list[str], text: str, after: int = 0) -> tuple[str, bool]:
    """Read one character at a time; the first stop to complete (the longest of those) cuts; one
    completing within the first `after` characters (fed before min_tokens) does not count."""
    for end in range(after + 1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(map(len, done))], True
    return text, False


def test_the_first_stop_to_complete_wins_however_the_text_is_split() -> None:
    assert run(["abc", "b"], ["abc"]) == ("a", True)
    assert run(["abc", "b"], ["a", "b", "c"]) == ("a", True)
    assert run(["bc", "abc"], ["abc"]) == ("", True)  # both complete at "c": the longest


def test_unarmed_text_ends_nothing_and_armed_text_does() -> None:
    # min_tokens: the first pieces come before the min_tokens-th token.
    m = StopMatcher(["END"])
    assert m.feed("aEND", armed=False) + m.feed("b", armed=False) == "aENDb" and not m.stopped
    assert m.feed("cEND") == "c" and m.stopped
    # A match that began before min_tokens but ends after it counts.
    m = StopMatcher(["END"])
    assert m.feed("xEN", armed=False) == "x" and m.feed("Dy") == "" and m.stopped
    # Negative control: the same pieces armed stop at the first match.
    assert run(["END"], ["aEND", "b"]) == ("a", True)


def test_an_unarmed_match_held_back_as_a_prefix_still_ends_nothing() -> None:
    m = StopMatcher(["a", "bab"])
    assert m.feed("ba", armed=False) == ""  # "ba" might become "bab"; its "a" came too early
    assert m.feed("") == "" and m.feed("x") == "bax" and not m.stopped
    assert m.feed("a") == "" and m.stopped


@given(
    text=st.text(alphabet="abcE\nND", max_size=40),
    stops=st.lists(st.text(alphabet="abcE\nND", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    unarmed=st.integers(0, 9),
)
def test_streaming_with_min_tokens_equals_cutting_after_the_unarmed_text(
    text: str, stops: list[str], cuts: list[int], unarmed: int
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    m = StopMatcher(stops)
    out = "".join(m.feed(p, armed=i >= unarmed) for i, p in enumerate(pieces)) + m.finish()
    early = len("".join(pieces[:unarmed]))
    assert (out, m.stopped) == reference(stops, text, after=early)
