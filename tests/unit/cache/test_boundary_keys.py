"""Prefill's boundary keys (prefill_svc/boundary_cache.py): a hash chain over a prompt's chunks,
so two prompts share the key of boundary b exactly when they share their first b tokens and
the engine's identity."""

from __future__ import annotations

from prefill_svc.boundary_cache import boundary_keys, root_key

ROOT = root_key("tiny", 1, "PagedEngine", 4, 32)


def test_keys_name_the_tokens_up_to_each_boundary_below_the_limit() -> None:
    prompt = list(range(10, 24))  # 14 tokens
    keys = boundary_keys(ROOT, prompt, 4, 13)
    assert [b for b, _ in keys] == [4, 8, 12]
    assert boundary_keys(ROOT, prompt, 4, 12) == keys[:2]  # a boundary at the limit is not one (a chunk must be left)
    other = [*prompt[:6], 99, *prompt[7:]]  # differs in the second chunk
    got = boundary_keys(ROOT, other, 4, 13)
    assert got[0] == keys[0] and got[1][1] != keys[1][1] and got[2][1] != keys[2][1]
    assert boundary_keys(ROOT, [*prompt, 1, 2, 3], 4, 17)[:3] == keys  # a longer prompt: the same prefix keys


def test_another_engine_identity_never_matches() -> None:
    prompt = list(range(16))
    keys = {k for _, k in boundary_keys(ROOT, prompt, 4, 16)}
    for root in (
        root_key("tiny", 2, "PagedEngine", 4, 32),
        root_key("tiny", 1, "PagedEngine", 4, 64),
        root_key("other", 1, "PagedEngine", 4, 32),
    ):
        assert keys.isdisjoint(k for _, k in boundary_keys(root, prompt, 4, 16))
