"""Whole-sequence (prefill-style) forms of every mixer, for cross-checking the step loop.

These mirror the kernels real engines use for prefill: causal attention as one masked matrix,
Mamba2's chunked SSD, GDN's chunked WY form, Mamba1's associative scan. They are NOT used for
exactness: in floating point they differ from the loop by rounding, so tests compare them with
a tolerance (logits and final states), never by tokens. A fresh request (zero state) only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.reference.attention import Attention, apply_rope
from shared.engine.reference.gdn import GatedDeltaNet
from shared.engine.reference.mamba1 import Mamba1
from shared.engine.reference.mamba2 import Mamba2
from shared.engine.reference.model import ReferenceModel, SSMMixer
from shared.engine.reference.numerics import rms_norm
from shared.engine.reference.state_store import GlobalState

DEFAULT_CHUNK = 8  # small, so that short test prompts still span several chunks


def causal_conv_sequence(xin: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Conv over `[T, C]` from a zero window: (silu outputs `[T, C]`, final window `[C, K-1]`)."""
    k = weight.shape[1]
    padded = torch.cat((xin.new_zeros(k - 1, xin.shape[1]), xin), dim=0)  # [K-1+T, C]
    windows = padded.unfold(0, k, 1)  # [T, C, K]
    out = (windows * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), padded[-(k - 1) :].T.contiguous()


def attention_sequence(attn: Attention, h: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
    """Full causal attention over `[T, hidden]`: (out `[T, hidden]`, K and V `[T, KV, hd]`)."""
    d, t = attn.dims, h.shape[0]
    q = F.linear(h, attn.wq).view(t, d.num_heads, d.head_dim)
    k = F.linear(h, attn.wk).view(t, d.num_kv_heads, d.head_dim)
    v = F.linear(h, attn.wv).view(t, d.num_kv_heads, d.head_dim)
    if rope is not None:
        cos, sin = rope[0][:t, None, :], rope[1][:t, None, :]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    g = d.num_heads // d.num_kv_heads
    qg = q.view(t, d.num_kv_heads, g, d.head_dim).permute(1, 2, 0, 3) * attn.scale  # [KV, g, T, hd]
    scores = qg @ k.permute(1, 2, 0).unsqueeze(1)  # [KV, g, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out = (probs @ v.permute(1, 0, 2).unsqueeze(1)).permute(2, 0, 1, 3).reshape(t, -1)  # [T, Hq*hd]
    return F.linear(out, attn.wo), k, v


def _pad_to_chunks(x: Tensor, chunk: int) -> Tensor:
    """Zero-pad the time axis (0) to a multiple of `chunk` and split it: `[nc, chunk, ...]`."""
    pad = (-x.shape[0]) % chunk
    if pad:
        x = torch.cat((x, x.new_zeros(pad, *x.shape[1:])), dim=0)
    return x.view(-1, chunk, *x.shape[1:])


def mamba2_sequence(m: Mamba2, h: Tensor, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked SSD: (out `[T, hidden]`, conv `[I+2GN, K-1]`, ssm `[H, P, N]`).

    Inside a chunk with cumulative log-decay L_i: y_i = sum_{j<=i} (C_i.B_j) e^{L_i-L_j} dt_j x_j
    + e^{L_i} S_prev C_i + D x_i; chunk states chain as S_c = e^{L_last} S_{c-1} + S_local.
    Padding steps have dt = 0: no decay, no input, so the final state is unaffected.
    """
    d, t = m.d, h.shape[0]
    hh, p, n = d.num_heads, d.head_dim, d.d_state
    z, xbc, dt = m.split_in_proj(F.linear(h, m.in_proj))
    xbc, conv = causal_conv_sequence(xbc, m.conv_w, m.conv_b)
    x = xbc[:, : m.i].reshape(t, hh, p)
    b = xbc[:, m.i : m.i + m.gn].reshape(t, d.n_groups, n).repeat_interleave(m.heads_per_group, dim=1)
    c = xbc[:, m.i + m.gn :].reshape(t, d.n_groups, n).repeat_interleave(m.heads_per_group, dim=1)
    dt = F.softplus(dt + m.dt_bias)  # [T, H]
    xc, bc, cc, dtc = (_pad_to_chunks(a, chunk) for a in (x, b, c, dt))
    cum = torch.cumsum(dtc * m.A, dim=1)  # [nc, L, H]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=h.device).tril()
    seg = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(~causal[None, :, :, None], float("-inf"))  # [nc,i,j,H]
    scores = torch.einsum("cihn,cjhn->cijh", cc, bc) * torch.exp(seg) * dtc.unsqueeze(1)
    y_diag = torch.einsum("cijh,cjhp->cihp", scores, xc)
    to_end = torch.exp(cum[:, -1:, :] - cum) * dtc  # [nc, L, H]
    local = torch.einsum("cjh,cjhp,cjhn->chpn", to_end, xc, bc)
    state = h.new_zeros(hh, p, n)
    y_off = []
    for ci in range(cum.shape[0]):  # one iteration per chunk: the inter-chunk recurrence
        y_off.append(torch.einsum("ih,hpn,ihn->ihp", torch.exp(cum[ci]), state, cc[ci]))
        state = torch.exp(cum[ci, -1]).view(hh, 1, 1) * state + local[ci]
    y = (y_diag + torch.stack(y_off)).reshape(-1, hh, p)[:t] + m.D.view(1, hh, 1) * x
    return m.gated_norm_out(y.reshape(t, -1), z), conv, state


def gdn_sequence(m: GatedDeltaNet, h: Tensor, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked WY gated delta rule: (out `[T, hidden]`, conv, ssm `[Hv, Dv, Dk]`).

    Math in the HF orientation S `[Dk, Dv]` per head, transposed to vLLM's at the end. Padding
    steps have beta = 0 and g = 0: the state passes through unchanged.
    """
    d, t = m.d, h.shape[0]
    qkv, z, b, a = m.split_in_proj(F.linear(h, m.in_proj))
    qkv, conv = causal_conv_sequence(qkv, m.conv_w, None)
    q, k, v = m.split_qkv(qkv)  # [T, Hv, Dk], [T, Hv, Dk], [T, Hv, Dv]
    beta, g = m.gates(b, a)  # [T, Hv]
    # Heads first: [Hv, nc, L, ...]
    qc, kc, vc, bc, gc = (_pad_to_chunks(x, chunk).movedim(2, 0) for x in (q, k, v, beta, g))
    gamma = torch.cumsum(gc, dim=-1)  # [Hv, nc, L]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=h.device).tril()
    decay = torch.exp((gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")))  # [Hv,nc,i,j]
    eye = torch.eye(chunk, device=h.device)
    m_lower = (bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    t_inv = torch.linalg.solve_triangular(eye + m_lower, eye.expand_as(m_lower), upper=False, unitriangular=True)
    u = t_inv @ (bc.unsqueeze(-1) * vc)
    w = t_inv @ (bc.unsqueeze(-1) * kc * torch.exp(gamma).unsqueeze(-1))
    attn = (qc @ kc.transpose(-1, -2)) * decay  # includes the diagonal
    state = h.new_zeros(d.num_v_heads, d.head_k_dim, d.head_v_dim)
    outs = []
    for ci in range(gamma.shape[1]):  # inter-chunk recurrence
        v_new = u[:, ci] - w[:, ci] @ state
        outs.append((qc[:, ci] * torch.exp(gamma[:, ci]).unsqueeze(-1)) @ state + attn[:, ci] @ v_new)
        g_last = gamma[:, ci, -1:]  # [Hv, 1]
        to_end = torch.exp(g_last - gamma[:, ci]).unsqueeze(-1)
        state = torch.exp(g_last).unsqueeze(-1) * state + (kc[:, ci] * to_end).transpose(-1, -2) @ v_new
    o = torch.cat(outs, dim=1).movedim(0, 1)[:t]  # [T, Hv, Dv]
    return m.norm_gate_out(o, z), conv, state.transpose(-1, -2).contiguous()


def mamba1_sequence(m: Mamba1, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Associative (Hillis-Steele) scan of S_t = a_t * S_{t-1} + b_t, combine
    (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2): (out `[T, hidden]`, conv, ssm `[D, N]`)."""
    dd, t = m.d.d_inner, h.shape[0]
    xz = F.linear(h, m.in_proj)
    x, z = xz[:, :dd], xz[:, dd:]
    x, conv = causal_conv_sequence(x, m.conv_w, m.conv_b)
    delta, b, c = m.selective_params(x)
    a_t = torch.exp(delta.unsqueeze(-1) * m.A)  # [T, D, N]
    b_t = (delta * x).unsqueeze(-1) * b.unsqueeze(1)
    offset = 1
    while offset < t:
        b_t = torch.cat((b_t[:offset], a_t[offset:] * b_t[:-offset] + b_t[offset:]))
        a_t = torch.cat((a_t[:offset], a_t[offset:] * a_t[:-offset]))
        offset *= 2
    y = (b_t @ c.unsqueeze(-1)).squeeze(-1) + m.D * x
    return F.linear(y * F.silu(z), m.out_proj), conv, b_t[-1]


def ssm_sequence(mixer: SSMMixer, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if isinstance(mixer, Mamba2):
        return mamba2_sequence(mixer, h)
    if isinstance(mixer, GatedDeltaNet):
        return gdn_sequence(mixer, h)
    return mamba1_sequence(mixer, h)


def parallel_prefill(model: ReferenceModel, tokens: Sequence[int]) -> tuple[Tensor, GlobalState]:
    """Logits `[T, vocab]` of every prompt position and the final state, computed layer by layer
    over the whole sequence with the parallel forms (a fresh request)."""
    if not tokens:
        raise ValueError("empty prompt")
    x = model.embed[torch.tensor(list(tokens), device=model.device)]
    kv: dict[int, tuple[Tensor, Tensor]] = {}
    ssm: dict[int, tuple[Tensor, Tensor]] = {}
    for layer in model.layers:
        if layer.norm_mixer is not None:
            h = rms_norm(x, layer.norm_mixer)
            mixed = torch.zeros_like(x)
            if layer.attn is not None:
                out, k, v = attention_sequence(layer.attn, h, model.rope)
                kv[layer.index] = (k, v)
                mixed = mixed + out
            if layer.ssm is not None:
                out, conv, state = ssm_sequence(layer.ssm, h)
                ssm[layer.index] = (conv, state)
                mixed = mixed + out
            x = x + mixed
        x = x + layer.mlp(rms_norm(x, layer.norm_mlp))
    logits = F.linear(rms_norm(x, model.final_norm), model.lm_head)
    return logits, GlobalState(length=len(tokens), kv=kv, ssm=ssm)
