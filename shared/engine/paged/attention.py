"""Softmax attention of one request over its own K/V: its projections for prefill chunks and
decode steps alike, `attend` for a decode step's query (a prefill chunk's queries run the same
rows a block at a time: chunk_attention.py).

Shapes depend only on the request (its query tokens and its cached length), never on which
requests share a decode step: that is what keeps decode batch-invariant here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from shared.engine.paged.attention_kernel import AttentionKernel
from shared.engine.paged.norms import rms_norm
from shared.engine.paged.tiles import linear


@dataclass
class Rope:
    """Rotary embedding on the first `dim` channels of each head (rotate-half convention).
    Scaled RoPE types come in through `inv_freq` and `scaling`, the attention factor that
    multiplies cos and sin (yarn's), both from transformers' initialisation (families.py)."""

    inv_freq: Tensor  # [dim / 2], fp32
    scaling: float = 1.0

    @property
    def dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def apply(self, x: Tensor, positions: Tensor) -> Tensor:
        """`x` [rows, heads, head_dim] at `positions` [rows]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.scaling).to(x.dtype)[:, None, :]
        sin = (emb.sin() * self.scaling).to(x.dtype)[:, None, :]
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos + rotated * sin
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


@dataclass
class Attention:
    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj")

    q_proj: Tensor
    k_proj: Tensor
    v_proj: Tensor
    o_proj: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    rope: Rope | None = None
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    o_bias: Tensor | None = None
    # Qwen3-Next / Qwen3.5 gated attention: q_proj also yields a per-head gate; q/k RMSNorms.
    gated: bool = False
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    norm_eps: float = 1e-6
    key_scale: float = 1.0  # Falcon-H1's key_multiplier (on K before RoPE)

    def qkv(self, h: Tensor, positions: Tensor, *, invariant: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Q [rows, heads, hd], K and V [rows, kv_heads, hd] (RoPE applied) and the output gate."""
        rows = h.shape[0]
        q = linear(h, self.q_proj, self.q_bias, invariant=invariant)
        gate = None
        if self.gated:
            q, gate = q.view(rows, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(rows, self.num_heads * self.head_dim)
        q = q.reshape(rows, self.num_heads, self.head_dim)
        k = linear(h, self.k_proj, self.k_bias, invariant=invariant).view(rows, self.num_kv_heads, self.head_dim)
        if self.key_scale != 1.0:
            k = k * self.key_scale
        v = linear(h, self.v_proj, self.v_bias, invariant=invariant).view(rows, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.norm_eps, offset=1.0)
            k = rms_norm(k, self.k_norm, self.norm_eps, offset=1.0)
        if self.rope is not None:
            q, k = self.rope.apply(q, positions), self.rope.apply(k, positions)
        return q, k, v, gate

    def attend(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Causal attention of queries at positions start.. over K/V of positions 0.. ([S, kv, hd]):
        [T, heads * hd]."""
        t, s = q.shape[0], k.shape[0]
        kv, rep, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        # Query heads j * rep .. j * rep + rep - 1 share KV head j: each KV head's queries are
        # one [rep * t, hd] matrix against its keys, no K/V copied per query head.
        qh = q.view(t, kv, rep, hd).permute(1, 2, 0, 3).reshape(kv, rep * t, hd)
        scores = torch.matmul(qh, k.permute(1, 2, 0)) * self.scaling  # [kv, rep * t, s]
        if t > 1:
            key_pos = torch.arange(s, device=q.device)
            query_pos = torch.arange(start, start + t, device=q.device).repeat(rep)
            scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v.transpose(0, 1))  # [kv, rep * t, hd]
        return out.view(kv, rep, t, hd).permute(2, 0, 1, 3).reshape(t, self.num_heads * hd)

    def attend_tokens(self, q: Tensor, kv: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        """A decode step's attention: request b's query token `q[b]` ([heads, hd]) over its own
        K/V of positions 0.. (`kv[b]`, head-major [kv_heads, S_b, hd]): [len(kv), heads * hd].

        No mask (every key is in the past) and no copies: each KV head's `rep` queries are one
        [rep, hd] matrix against its keys. Each request's products have its own shapes only. The
        scaling goes on the queries (every row alike), not on each request's scores."""
        n, kv_heads, hd = len(kv), self.num_kv_heads, self.head_dim
        queries = (q * self.scaling)[:n].reshape(n, kv_heads, self.num_heads // kv_heads, hd).unbind(0)
        outs = []
        for qb, (kb, vb) in zip(queries, kv):
            probs = torch.softmax(torch.bmm(qb, kb.transpose(1, 2)), dim=-1, dtype=torch.float32)
            outs.append(torch.bmm(probs if q.dtype == torch.float32 else probs.to(q.dtype), vb))
        return torch.stack(outs).view(n, self.num_heads * hd)

    def attend_in_pages(
        self,
        q: Tensor,
        fa: Tensor,
        table: Tensor,
        lengths: Tensor,
        kernel: AttentionKernel,
        *,
        block_size: int,
        kernels_per_block: int,
    ) -> Tensor:
        """`attend_tokens` for an fp32 model by the C kernel (attention_kernel.py), K/V read where
        they lie in `fa` through the requests' block `table` (`lengths[b]` tokens each): [n,
        heads * hd], in the kernel's order (last bits apart from `attend_tokens`)."""
        n = table.shape[0]
        queries = (q * self.scaling)[:n].reshape(n, self.num_heads, self.head_dim).contiguous()
        out = kernel(fa, table, lengths, queries, block_size=block_size, kernels_per_block=kernels_per_block)
        return out.view(n, self.num_heads * self.head_dim)

    def output(self, attn: Tensor, gate: Tensor | None, *, invariant: bool) -> Tensor:
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        return linear(attn, self.o_proj, self.o_bias, invariant=invariant)
