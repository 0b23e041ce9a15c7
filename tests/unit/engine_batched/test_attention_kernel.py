"""The decode attention kernel (attention_kernel.py, built from attention_decode.c), reading K/V
where they lie in the kernel blocks: equal to a float64 reference and to the torch path
(`Attention.attend_tokens` over gathered K/V) within rounding; a request's bits depend neither on
the other requests nor on which blocks hold its tokens; lengths or block ids outside the table or
the cache are refused before any memory is read."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from shared.engine.paged.attention import Attention
from shared.engine.paged.attention_kernel import AttentionKernel, attention_kernel

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 12  # head_dim 12: one lane group of 8 and a tail of 4
KERNEL_BLOCK, PER_BLOCK = 4, 2  # a logical block of 8 tokens is two kernel blocks
BLOCKS = 12


@pytest.fixture(scope="module")
def kernel() -> AttentionKernel:
    built = attention_kernel()
    if built is None:
        pytest.fail("the attention kernel did not build: this machine has a C compiler, so it must")
    return built


def _cache() -> Tensor:
    return torch.randn(BLOCKS * PER_BLOCK, 2, KV_HEADS, KERNEL_BLOCK, HEAD_DIM, generator=torch.Generator().manual_seed(7))


def _place(fa: Tensor, blocks: list[int], k: Tensor, v: Tensor) -> None:
    """Token t's K/V ([T, kv_heads, hd]) into logical block blocks[t // 8]."""
    size = KERNEL_BLOCK * PER_BLOCK
    for t in range(k.shape[0]):
        within = t % size
        kb = blocks[t // size] * PER_BLOCK + within // KERNEL_BLOCK
        fa[kb, 0, :, t % KERNEL_BLOCK] = k[t]
        fa[kb, 1, :, t % KERNEL_BLOCK] = v[t]


def _table(rows: list[list[int]]) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64)


def _attend(kernel: AttentionKernel, fa: Tensor, rows: list[list[int]], lengths: list[int], q: Tensor) -> Tensor:
    return kernel(fa, _table(rows), torch.tensor(lengths), q, block_size=KERNEL_BLOCK * PER_BLOCK, kernels_per_block=PER_BLOCK)


def _kv(length: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, KV_HEADS, HEAD_DIM, generator=g), torch.randn(length, KV_HEADS, HEAD_DIM, generator=g)


def test_equals_float64_and_the_torch_path_within_rounding(kernel: AttentionKernel) -> None:
    fa = _cache()
    lengths, rows = [1, 8, 19], [[3], [0], [5, 1, 9]]
    kv = [_kv(n, seed=n) for n in lengths]
    for (k, v), blocks in zip(kv, rows):
        _place(fa, blocks, k, v)
    q = torch.randn(3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    got = _attend(kernel, fa, rows, lengths, q)
    rep = HEADS // KV_HEADS
    for b, (k, v) in enumerate(kv):
        scores = torch.einsum("hd,thd->ht", q[b].double(), k.double().repeat_interleave(rep, dim=1))
        want = torch.einsum("ht,thd->hd", scores.softmax(-1), v.double().repeat_interleave(rep, dim=1))
        assert torch.allclose(got[b].double(), want, rtol=1e-5, atol=1e-6), b
    # The torch path: Attention.attend_tokens over the same K/V, head-major, scaling 1.
    attention = Attention.__new__(Attention)
    attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.scaling = HEADS, KV_HEADS, HEAD_DIM, 1.0
    torch_path = attention.attend_tokens(q.reshape(3, -1), [(k.transpose(0, 1), v.transpose(0, 1)) for k, v in kv])
    assert torch.allclose(got.reshape(3, -1), torch_path, rtol=1e-5, atol=1e-6)
    # Negative control: the two paths' orders give other bits somewhere, so the bit comparisons
    # below can tell orders apart.
    assert not torch.equal(got.reshape(3, -1), torch_path)


def test_a_requests_bits_depend_neither_on_the_others_nor_on_its_blocks(kernel: AttentionKernel) -> None:
    k, v = _kv(13, seed=3)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    fa = _cache()
    _place(fa, [2, 7], k, v)
    alone = _attend(kernel, fa, [[2, 7]], [13], q)
    for where, others in ((0, 1), (2, 4), (5, 7)):
        fa = _cache()
        blocks = [10 - where, 11 - where]  # elsewhere in the cache
        _place(fa, blocks, k, v)
        rows = [[(3 * i) % BLOCKS, (3 * i + 1) % BLOCKS] for i in range(others)]
        lengths = [1 + (5 * i) % 16 for i in range(others)]
        rows.insert(where, blocks)
        lengths.insert(where, 13)
        queries = torch.randn(others + 1, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(others))
        queries[where] = q[0]
        got = _attend(kernel, fa, rows, lengths, queries)
        assert torch.equal(got[where], alone[0]), (where, others)


def test_lengths_and_blocks_outside_are_refused(kernel: AttentionKernel) -> None:
    fa, q = _cache(), torch.randn(1, HEADS, HEAD_DIM)
    with pytest.raises(IndexError, match="need more blocks than the table"):
        _attend(kernel, fa, [[1, 2]], [17], q)  # 17 tokens need three blocks of 8
    with pytest.raises(IndexError, match="need more blocks"):
        _attend(kernel, fa, [[1]], [0], q)  # attending over nothing
    with pytest.raises(IndexError, match="need more blocks"):
        _attend(kernel, fa, [[1]], [2**63 - 1], q)  # no scratch of that size, no overflow in the check
    with pytest.raises(IndexError, match="block ids outside the cache's 12 blocks"):
        _attend(kernel, fa, [[1, BLOCKS]], [9], q)
    with pytest.raises(ValueError, match="q must be a contiguous fp32"):
        _attend(kernel, fa, [[1]], [3], q.double())
    with pytest.raises(ValueError, match="the cache must be fp32"):
        _attend(kernel, fa.half(), [[1]], [3], q)
    with pytest.raises(ValueError, match="table"):
        _attend(kernel, fa, [[1], [2]], [3, 3], q)  # two requests' tables, one query
