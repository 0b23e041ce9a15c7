"""Causal attention of one prefill chunk over its own K/V, a block of queries at a time, so
no [T, T] score matrix is ever made.

Each block of `QUERY_BLOCK` queries scores only the keys its last query may see (the causal
half of the work that lies above the diagonal is skipped) and masks the block's own diagonal
square. A query's row is then what `Attention.attend` computes for it: scores, fp32 softmax
over the whole row, probabilities cast to the compute dtype, times V, the rounding decode
applies to its one query too. The blocks start at the chunk's first token, so a token's bits
depend on the chunk's length and start only, never on the chunks beside it in a forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Queries per block: a fixed count, so block shapes follow from the chunk alone.
QUERY_BLOCK = 64


def causal_chunk_attention(q: Tensor, k: Tensor, v: Tensor, start: int, scaling: float) -> Tensor:
    """Queries `q` [T, heads, hd] at positions start.. over `k`, `v` [start + T, kv_heads, hd]
    (positions 0..): [T, heads * hd]. Query heads j * rep .. j * rep + rep - 1 read KV head j."""
    t, heads, hd = q.shape
    kv = k.shape[1]
    if k.shape[0] != start + t or v.shape[0] != start + t:
        raise ValueError(f"k, v: {k.shape[0]}, {v.shape[0]} positions for queries at {start}..{start + t - 1}")
    if heads % kv:
        raise ValueError(f"q: {heads} heads are not a multiple of the {kv} KV heads")
    rep = heads // kv
    keys_t, values = k.permute(1, 2, 0), v.transpose(0, 1)  # [kv, hd, S], [kv, S, hd]
    above = torch.ones(QUERY_BLOCK, QUERY_BLOCK, dtype=torch.bool, device=q.device).triu(1)
    full_block_mask = above.repeat(rep, 1)  # [rep * QUERY_BLOCK, QUERY_BLOCK], made once
    out = q.new_empty((t, heads * hd))
    for first in range(0, t, QUERY_BLOCK):
        n = min(QUERY_BLOCK, t - first)
        seen = start + first + n  # keys 0 .. seen-1; the block's own n of them need the mask
        # Each KV head's queries are one [rep * n, hd] matrix (rows query-head-major).
        qh = q[first : first + n].view(n, kv, rep, hd).permute(1, 2, 0, 3).reshape(kv, rep * n, hd)
        scores = torch.matmul(qh, keys_t[:, :, :seen]) * scaling  # [kv, rep * n, seen]
        mask = full_block_mask if n == QUERY_BLOCK else above[:n, :n].repeat(rep, 1)
        scores[:, :, seen - n :].masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        block = torch.matmul(probs, values[:, :seen])  # [kv, rep * n, hd]
        out[first : first + n] = block.view(kv, rep, n, hd).permute(2, 0, 1, 3).reshape(n, heads * hd)
    return out
