"""The id-array pool: reuse for large requests, the smallest array that fits, bounded idle memory."""

from __future__ import annotations

import numpy as np
import pytest

from shared.cache.id_buffers import MIN_POOLED_IDS, IdBufferPool


def test_large_arrays_come_back_and_are_reused() -> None:
    pool = IdBufferPool()
    claim = pool.claim()
    local, remote = claim(2 * MIN_POOLED_IDS)
    assert local.dtype == remote.dtype == np.int32 and len(local) == len(remote) == 2 * MIN_POOLED_IDS
    assert not np.shares_memory(local, remote)
    claim.release()
    claim.release()  # twice: no effect
    assert pool.idle == 1
    again = pool.claim()
    assert again(MIN_POOLED_IDS)[0] is local  # a smaller request fits the same array
    assert pool.idle == 0 and pool.created == 1


def test_small_requests_and_too_small_arrays_get_fresh_ones() -> None:
    pool = IdBufferPool()
    small = pool.claim()
    small(10)
    small.release()
    assert pool.idle == 0  # never pooled
    big = pool.claim()
    big(MIN_POOLED_IDS)
    big.release()
    bigger = pool.claim()
    assert len(bigger(2 * MIN_POOLED_IDS)[0]) == 2 * MIN_POOLED_IDS  # the idle one is too small
    assert pool.idle == 1 and pool.created == 3


def test_picks_the_smallest_fit_and_keeps_the_largest_when_full() -> None:
    pool = IdBufferPool(max_idle=2)
    sizes = [MIN_POOLED_IDS * k for k in (3, 1, 2)]  # the smallest is not the first given back
    claims = [pool.claim() for _ in sizes]
    arrays = [c(n) for c, n in zip(claims, sizes)]
    for c in claims:
        c.release()
    assert pool.idle == 2  # the 1x pair was dropped: the larger ones serve it too
    assert pool.claim()(MIN_POOLED_IDS)[0] is arrays[2][0]  # 2x, the smallest that fits
    assert pool.claim()(MIN_POOLED_IDS)[0] is arrays[0][0]  # then 3x


def test_one_claim_serves_one_call_and_bad_arguments_are_refused() -> None:
    pool = IdBufferPool()
    claim = pool.claim()
    claim(1)
    with pytest.raises(RuntimeError):
        claim(1)
    with pytest.raises(ValueError):
        pool.take(-1)
    with pytest.raises(ValueError):
        IdBufferPool(max_idle=-1)
