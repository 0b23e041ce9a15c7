"""The gated delta rule (Gated DeltaNet) over one prefill chunk in blocks, instead of token by
token.

Per value head, with state S [Dv, Dk] (S k: what the state recalls for key k):
`S_t = g_t S_(t-1) + beta_t (v_t - g_t S_(t-1) k_t) k_t^T`, output `o_t = S_t q_t`. Within a
block of tokens the corrections `d_t = beta_t (v_t - g_t S_(t-1) k_t)` solve one unit lower
triangular system (each depends on the block's earlier ones through k_i^T k_t and the decay
between them), so a block is a few matmuls and one triangular solve; only the state passes
from block to block. Decays enter as exp of differences of cumulative log-decays, t >= i, so
every factor lies in (0, 1].

A token's bits depend on the chunk's length and its place in it, never on other chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Tokens per block (transformers' torch path uses 64): a block's [L, L] products, masks and
# triangular solve grow with L per token, while more, shorter blocks only add state hand-overs.
BLOCK = 32


def _blocks(x: Tensor, count: int, length: int) -> Tensor:
    """[T, H, ...] -> [count, H, length, ...], zero rows after token T."""
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, count * length - x.shape[0]))
    return padded.view(count, length, *x.shape[1:]).transpose(1, 2).contiguous()


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """q and k [T, H, Dk], v [T, H, Dv], log-decays g and beta [T, H], all fp32; state
    [H, Dv, Dk] (fp32) before the first token. Returns o [T, H, Dv] and the state after the
    last token."""
    t, heads, dv = v.shape
    length = min(BLOCK, t)
    count = -(-t // length)
    # Padding rows have k = v = beta = 0 and g = 0: they change no state.
    qb, kb, vb = _blocks(q, count, length), _blocks(k, count, length), _blocks(v, count, length)  # [C, H, L, D]
    gb = _blocks(g[..., None], count, length)[..., 0]  # [C, H, L]
    bb = _blocks(beta[..., None], count, length)  # [C, H, L, 1]
    cum = torch.cumsum(gb, dim=-1)  # [C, H, L]
    lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    # decay[t, i] = exp(cum_t - cum_i) for i <= t (0 above: exp(-inf)).
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [C, H, L, L]
    # (I + A) d = beta (v - exp(cum) S0 k), A[t, i] = beta_t decay[t, i] k_t . k_i for i < t.
    a = (bb * torch.matmul(kb, kb.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([bb * vb, bb * cum.exp()[..., None] * kb], dim=-1)
    eye = torch.eye(length, dtype=q.dtype, device=q.device)
    solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]  # d = u - w S0^T
    attend = torch.matmul(qb, kb.transpose(-1, -2)) * decay  # q_t . k_i decayed, i <= t
    q_decayed = qb * cum.exp()[..., None]
    k_to_end = kb * (cum[..., -1:] - cum).exp()[..., None]
    total = cum[..., -1].exp()[..., None, None]  # [C, H, 1, 1]
    out = torch.empty_like(vb)
    s = state.to(torch.float32)
    for c in range(count):
        d = u[c] - torch.matmul(w[c], s.transpose(-1, -2))  # [H, L, Dv]
        out[c] = torch.matmul(q_decayed[c], s.transpose(-1, -2)) + torch.matmul(attend[c], d)
        s = total[c] * s + torch.matmul(d.transpose(-1, -2), k_to_end[c])
    return out.transpose(1, 2).reshape(count * length, heads, dv)[:t], s


def delta_rule_sequential(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The same recurrence token by token: the oracle the tests hold the blocked form to, and
    the baseline of its benchmark."""
    s = state.to(torch.float32)
    decay = g.exp()
    outs = []
    for i in range(q.shape[0]):
        s = s * decay[i][:, None, None]
        remembered = (s * k[i][:, None, :]).sum(-1)
        delta = (v[i] - remembered) * beta[i][:, None]
        s = s + delta[:, :, None] * k[i][:, None, :]
        outs.append((s * q[i][:, None, :]).sum(-1))
    return torch.stack(outs), s
