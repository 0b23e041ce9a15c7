from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.cache.allocator import BlockAllocator, BlocksExhausted

pytestmark = pytest.mark.timeout(60)


class Ledger:
    """An allocator and what it handed out per request, as its callers see it (the allocator
    itself keeps no public per-request view: nothing in the services needs one)."""

    def __init__(self, num_blocks: int) -> None:
        self.alloc = BlockAllocator(num_blocks)
        self.given: dict[str, list[np.ndarray]] = {}

    def allocate(self, request_id: str, n: int, *, contiguous_preferred: bool = True) -> np.ndarray:
        ids = self.alloc.allocate(request_id, n, contiguous_preferred=contiguous_preferred)
        self.given.setdefault(request_id, []).append(ids)
        return ids

    def free(self, request_id: str) -> int:
        freed = self.alloc.free(request_id)
        assert freed == sum(int(p.size) for p in self.given.pop(request_id, [])), "freed count differs from what was given"
        return freed

    def held(self, request_id: str) -> list[int]:
        return [int(i) for part in self.given[request_id] for i in part]


def check_invariants(ledger: Ledger) -> None:
    """Held blocks are distinct, free and held partition all ids, counts agree."""
    alloc = ledger.alloc
    held = [ids for parts in ledger.given.values() for ids in parts]
    held_ids = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
    assert np.unique(held_ids).size == held_ids.size, "a block is handed out twice"
    starts, lengths = alloc.free_runs()
    free_ids = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)] or [np.empty(0, np.int64)])
    assert np.intersect1d(free_ids, held_ids).size == 0, "a held block is also free"
    assert np.array_equal(np.sort(np.concatenate([free_ids, held_ids])), np.arange(alloc.num_blocks))
    assert alloc.num_free == free_ids.size and alloc.num_used == held_ids.size


def runs_in(ids: np.ndarray) -> int:
    """How many maximal runs of consecutive ids (what NIXL merges into one descriptor)."""
    return 0 if ids.size == 0 else 1 + int(np.count_nonzero(np.diff(ids) != 1))


def fewest_runs_possible(alloc: BlockAllocator, n: int) -> int:
    """Slow reference: greedily take the longest free runs."""
    _, lengths = alloc.free_runs()
    covered, count = 0, 0
    for length in sorted(lengths.tolist(), reverse=True):
        if covered >= n:
            break
        covered += length
        count += 1
    return count


def test_accounting_of_allocate_and_free() -> None:
    ledger = Ledger(10)
    alloc = ledger.alloc
    a = ledger.allocate("a", 4)
    assert a.tolist() == [0, 1, 2, 3]
    b = ledger.allocate("b", 3)
    assert b.tolist() == [4, 5, 6]
    assert (alloc.num_free, alloc.num_used) == (3, 7)
    more = ledger.allocate("a", 2)  # a request may grow
    assert more.tolist() == [7, 8] and ledger.held("a") == [0, 1, 2, 3, 7, 8]
    check_invariants(ledger)
    assert ledger.free("a") == 6 and ledger.free("a") == 0  # freeing twice is harmless
    assert alloc.num_free == 7
    check_invariants(ledger)


def test_a_full_cache_raises_a_clear_error_and_changes_nothing() -> None:
    alloc = BlockAllocator(8)
    alloc.allocate("a", 6)
    with pytest.raises(BlocksExhausted, match=r"3 blocks requested, 2 of 8 free \(6 held by 1 requests\)") as full:
        alloc.allocate("b", 3)
    assert (full.value.requested, full.value.free, full.value.total) == (3, 2, 8)
    assert alloc.num_free == 2 and alloc.free("b") == 0  # "b" got nothing
    with pytest.raises(ValueError):
        alloc.allocate("b", -1)
    assert alloc.allocate("b", 0).size == 0 and alloc.num_free == 2


def test_contiguous_allocation_picks_the_shortest_run_that_fits() -> None:
    alloc = BlockAllocator(20)
    for rid, n in [("a", 5), ("gap3", 3), ("b", 2), ("gap6", 6), ("c", 4)]:
        alloc.allocate(rid, n)
    alloc.free("gap3")  # free run of 3 at 5..7
    alloc.free("gap6")  # free run of 6 at 10..15
    assert alloc.allocate("x", 3).tolist() == [5, 6, 7]
    assert alloc.allocate("y", 4).tolist() == [10, 11, 12, 13]


def test_fragmented_cache_falls_back_to_the_fewest_runs() -> None:
    ledger = Ledger(16)
    for i in range(8):
        ledger.allocate(f"r{i}", 2)
    for i in (0, 2, 3, 6):
        ledger.free(f"r{i}")  # free runs: 0..1, 4..7, 12..13
    ids = ledger.allocate("x", 7)
    assert ids.tolist() == [0, 4, 5, 6, 7, 12, 13] or ids.tolist() == [0, 1, 4, 5, 6, 7, 12]
    assert runs_in(ids) == 3
    scattered = BlockAllocator(4)
    assert scattered.allocate("x", 2, contiguous_preferred=False).tolist() == [0, 1]
    check_invariants(ledger)


def test_the_invariant_check_catches_a_block_handed_out_twice() -> None:
    """Negative control: a corrupted allocator must fail the check."""
    ledger = Ledger(8)
    alloc = ledger.alloc
    ledger.allocate("a", 3)
    check_invariants(ledger)
    alloc._free[1] = True  # corrupt: a held block marked free
    alloc._num_free += 1
    with pytest.raises(AssertionError):
        check_invariants(ledger)
    ledger.allocate("b", 6)  # now hands out block 1 again...
    with pytest.raises(AssertionError, match="twice"):
        check_invariants(ledger)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against the invariants and the slow run-count reference."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger(64)
        self.alloc = self.ledger.alloc
        self.next_id = 0

    @rule(n=st.integers(min_value=0, max_value=24), contiguous=st.booleans())
    def allocate(self, n: int, contiguous: bool) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        if n > self.alloc.num_free:
            with pytest.raises(BlocksExhausted):
                self.alloc.allocate(rid, n, contiguous_preferred=contiguous)
            return
        best = fewest_runs_possible(self.alloc, n)
        ids = self.ledger.allocate(rid, n, contiguous_preferred=contiguous)
        assert ids.size == n and ids.dtype == np.int64
        if contiguous:
            assert runs_in(ids) == best

    @precondition(lambda self: bool(self.ledger.given))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ledger.given)))
        held = len(self.ledger.held(rid))
        before = self.alloc.num_free
        assert self.ledger.free(rid) == held
        assert self.alloc.num_free == before + held

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.ledger)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=10), min_size=1, max_size=12))
def test_allocating_until_full_never_repeats_a_block(sizes: list[int]) -> None:
    alloc = BlockAllocator(40)
    given_out: list[np.ndarray] = []
    for i, n in enumerate(sizes):
        if n <= alloc.num_free:
            given_out.append(alloc.allocate(f"r{i}", n))
    ids = np.concatenate(given_out)
    assert np.unique(ids).size == ids.size and ids.min() >= 0 and ids.max() < 40


def test_transfer_hands_some_blocks_to_another_holder() -> None:
    """Decode's prefix cache takes a finished request's prompt blocks this way."""
    a = BlockAllocator(10)
    ids = a.allocate("req", 4)
    a.transfer("req", "cache", ids[:2])
    assert (a.held("req"), a.held("cache"), a.num_free) == (2, 2, 6)
    with pytest.raises(ValueError, match="does not hold"):
        a.transfer("req", "cache", ids[:1])  # no longer the request's
    assert a.free("req") == 2 and a.num_free == 8
    a.transfer("cache", "other", ids[:2])
    assert a.held("cache") == 0 and a.free("other") == 2 and a.num_free == 10
