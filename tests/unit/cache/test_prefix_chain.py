"""Decode's prefix-cache keys at a granularity (`Engine.prefix_stable_unit`): a block's key names
every token its K/V depend on (up to the end of the last unit it touches), and only blocks
whose reach lies within the computed tokens are cacheable. At unit 1 the keys are the plain
per-block chain."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from decode_svc.prefix_cache import cacheable_blocks, chain_keys, reach, root_key

pytestmark = pytest.mark.timeout(60)

ROOT = root_key("m", 1, "HfEngine", 48)


def test_unit_one_is_the_per_block_chain() -> None:
    tokens = list(range(100))
    previous, want = ROOT, []
    for b in range(6):
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(np.asarray(tokens[b * 16 : (b + 1) * 16], dtype=np.int64).tobytes())
        previous = h.digest()
        want.append(previous)
    assert chain_keys(ROOT, tokens, 16, 6) == chain_keys(ROOT, tokens, 16, 6, unit=1) == want
    assert cacheable_blocks(100, 16, 1) == 6


@pytest.mark.parametrize(
    "block,size,unit,want", [(0, 16, 48, 48), (2, 16, 48, 48), (3, 16, 48, 96), (0, 16, 24, 24), (1, 16, 24, 48), (0, 32, 20, 40)]
)
def test_a_block_reaches_the_end_of_its_last_unit(block: int, size: int, unit: int, want: int) -> None:
    assert reach(block, size, unit) == want


@pytest.mark.parametrize(
    "computed,size,unit,want",
    [(47, 16, 48, 0), (48, 16, 48, 3), (95, 16, 48, 3), (96, 16, 48, 6), (47, 16, 24, 1), (60, 32, 20, 1)],
)
def test_only_blocks_within_whole_units_are_cacheable(computed: int, size: int, unit: int, want: int) -> None:
    got = cacheable_blocks(computed, size, unit)
    assert got == want
    assert all(reach(b, size, unit) <= computed for b in range(got))
    assert reach(got, size, unit) > computed  # the next one would reach past the computed tokens


def test_a_key_changes_with_any_token_of_its_unit_even_after_the_block() -> None:
    """Blocks 0-2 share chunk [0, 48): a token at 40 (in block 2) changes block 0's key, since
    block 0's K/V came from that whole chunk; at unit 1 it does not."""
    a = list(range(96))
    b = [*a[:40], 999, *a[41:]]
    ka, kb = chain_keys(ROOT, a, 16, 6, unit=48), chain_keys(ROOT, b, 16, 6, unit=48)
    assert all(x != y for x, y in zip(ka, kb))
    assert chain_keys(ROOT, a, 16, 2) == chain_keys(ROOT, b, 16, 2)
    c = [*a[:50], 999, *a[51:]]  # in the second chunk: the first chunk's blocks keep their keys
    kc = chain_keys(ROOT, c, 16, 6, unit=48)
    assert ka[:3] == kc[:3] and all(x != y for x, y in zip(ka[3:], kc[3:]))


def test_keys_need_every_token_they_depend_on() -> None:
    with pytest.raises(ValueError, match="block 0 depends on 48 tokens"):
        chain_keys(ROOT, list(range(40)), 16, 1, unit=48)


def test_the_root_names_the_chunk_size() -> None:
    assert root_key("m", 1, "HfEngine", 48) != root_key("m", 1, "HfEngine", 40) != root_key("m", 1, "HfEngine")
