"""A prefill chunk's causal attention, a block of queries at a time: the values of the [T, T]
formula (`Attention.attend`, what decode runs), and a query's bits untouched by any key after
it (negative control: a key at or before it changes them)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from shared.engine.paged.attention import Attention
from shared.engine.paged.chunk_attention import QUERY_BLOCK, causal_chunk_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _inputs(t: int, start: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(start + t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(start + t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, k, v


def _attend(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    empty = torch.zeros(1)
    mixer = Attention(empty, empty, empty, empty, HEADS, KV_HEADS, HEAD_DIM, scaling=HEAD_DIM**-0.5)
    return mixer.attend(q, k, v, start)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(("t", "start"), [(1, 0), (1, 9), (17, 0), (QUERY_BLOCK, 5), (QUERY_BLOCK + 1, 0), (150, 33)])
def test_blocked_attention_has_the_values_of_the_full_score_matrix(t: int, start: int, dtype: torch.dtype, tol: float) -> None:
    q, k, v = _inputs(t, start, dtype)
    got = causal_chunk_attention(q, k, v, start, HEAD_DIM**-0.5)
    want = _attend(q, k, v, start)
    assert got.shape == want.shape == (t, HEADS * HEAD_DIM)
    assert float((got.float() - want.float()).abs().max()) <= tol


def test_a_query_never_reads_a_key_after_it() -> None:
    t, start, row = 2 * QUERY_BLOCK + 5, 7, QUERY_BLOCK + 3  # a row inside the second block
    q, k, v = _inputs(t, start, torch.float32)
    base = causal_chunk_attention(q, k, v, start, HEAD_DIM**-0.5)
    later = start + row + 1  # the first key after the row's position
    k2, v2 = k.clone(), v.clone()
    k2[later:] += 3.0
    v2[later:] -= 5.0
    after = causal_chunk_attention(q, k2, v2, start, HEAD_DIM**-0.5)
    assert torch.equal(after[: row + 1], base[: row + 1])
    # Negative control: the row's own key, and one before it, do change its bits.
    for position in (later - 1, 0):
        k3 = k.clone()
        k3[position] += 3.0
        assert not torch.equal(causal_chunk_attention(q, k3, v, start, HEAD_DIM**-0.5)[row], base[row])


def test_wrong_lengths_are_refused_naming_them() -> None:
    q, k, v = _inputs(4, 2, torch.float32)
    with pytest.raises(ValueError, match=r"k, v: 6, 6 positions for queries at 3\.\.6"):
        causal_chunk_attention(q, k, v, 3, 1.0)
