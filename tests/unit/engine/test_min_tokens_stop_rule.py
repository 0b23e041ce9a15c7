"""The stop rule with min_tokens: a stop id ends the generation only from min_tokens tokens on
(engines without logits cannot mask it); max_tokens still ends it."""

from __future__ import annotations

from shared.engine.stopping import StopRule


def test_a_stop_id_before_min_tokens_does_not_end() -> None:
    rule = StopRule.of(5, frozenset({9}), [4], min_tokens=3)
    assert [rule.finish(9, n) for n in (1, 2, 3)] == [None, None, "stop"]
    assert [rule.finish(4, n) for n in (2, 3)] == [None, "stop"]
    assert rule.finish(1, 5) == "length"
    # Negative control: without min_tokens the first stop id ends it.
    assert StopRule.of(5, frozenset({9}), [4]).finish(9, 1) == "stop"
    # ignore_eos leaves the request's own ids.
    assert StopRule.of(5, frozenset({9}), [4], ignore_eos=True, min_tokens=1).stop_token_ids == {4}
