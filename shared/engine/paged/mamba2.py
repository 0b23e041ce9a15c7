"""The Mamba2 mixer (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1) on explicit states.

States in the layout's conventions: conv `[C, K-1]` raw conv inputs (oldest..newest), SSM
`[H, P, N]` in fp32. Prefill runs the chunked SSD scan (one request, any number of tokens,
from any state); a decode step runs the recurrence for a tile of requests at once, each row
its own request, with shapes fixed by the tile (tiles.py). The dtype flow follows
transformers' torch paths (recurrent state fp32, step outputs in the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged.conv_kernel import ConvStepKernel
from shared.engine.paged.conv_step import conv_step
from shared.engine.paged.mamba2_kernel import Mamba2StateKernel
from shared.engine.paged.norms import falcon_gated_rms_norm, gated_rms_norm
from shared.engine.paged.tiles import linear

# Most tokens per block of the prefill's SSD scan. The math is the same at any block size; the
# checkpoint's chunk_size tiles GPU kernels, while here a block's [L, L] decay matrix (its
# exp, cumsum and masks, which dominate the scan on a CPU) grows with L per token, and more,
# shorter blocks only add cheap state hand-overs.
SCAN_BLOCK = 32
NO_DT_LIMIT = (0.0, float("inf"))


@dataclass
class Mamba2:
    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("in_proj", "out_proj")

    in_proj: Tensor
    conv_weight: Tensor  # [C, K]
    conv_bias: Tensor | None
    dt_bias: Tensor
    A: Tensor  # -exp(A_log), fp32, [H]
    D: Tensor
    out_proj: Tensor
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    chunk_size: int
    norm_weight: Tensor | None  # None: no gated norm (Falcon-H1 without mamba_rms_norm): y * silu(z)
    norm_eps: float
    norm_groups: int
    dt_limit: tuple[float, float] = NO_DT_LIMIT
    in_bias: Tensor | None = None
    out_bias: Tensor | None = None
    # Falcon-H1's muP: a multiplier of the input, per-channel multipliers of the in_proj output
    # ([z | x | B | C | dt]), and its own gated norm (weight in fp32, gate before or after).
    in_scale: float = 1.0
    in_multipliers: Tensor | None = None
    falcon_norm: bool = False
    norm_before_gate: bool = False

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.d_state

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.d_state)

    def _project(self, h: Tensor, invariant: bool) -> tuple[Tensor, Tensor, Tensor]:
        if self.in_scale != 1.0:
            h = h * self.in_scale
        zxbcdt = linear(h, self.in_proj, self.in_bias, invariant=invariant)
        if self.in_multipliers is not None:
            zxbcdt = zxbcdt * self.in_multipliers
        z, xbc, dt = torch.split(zxbcdt, [self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        return z, xbc, dt

    def _split(self, xbc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        gn = self.n_groups * self.d_state
        x, b, c = torch.split(xbc, [self.intermediate, gn, gn], dim=-1)
        return x, b, c

    def _finish(self, y: Tensor, z: Tensor, dtype: torch.dtype, invariant: bool) -> Tensor:
        if self.norm_weight is not None and self.falcon_norm:
            y = falcon_gated_rms_norm(y, z, self.norm_weight, self.norm_eps, self.norm_groups, before_gate=self.norm_before_gate)
        elif self.norm_weight is not None:
            y = gated_rms_norm(y, z, self.norm_weight, self.norm_eps, self.norm_groups)
        else:
            y = y * F.silu(z)
        return linear(y.to(dtype), self.out_proj, self.out_bias, invariant=invariant)

    # --- prefill: one request, T tokens -------------------------------------------------
    def prefill(self, h: Tensor, conv: Tensor, ssm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`h` [T, hidden] after `conv` [C, K-1] and `ssm` [H, P, N]: output [T, hidden] and the
        states after the T tokens."""
        t, dtype = h.shape[0], h.dtype
        z, xbc, dt = self._project(h, False)
        window = torch.cat([conv.to(dtype), xbc.transpose(0, 1)], dim=1)  # [C, K-1+T]
        new_conv = window[:, -(self.conv_weight.shape[1] - 1) :].contiguous()
        mixed = F.conv1d(window[None], self.conv_weight[:, None, :], self.conv_bias, groups=self.conv_dim)[0]
        xbc = F.silu(mixed).transpose(0, 1)  # [T, C]
        x, b, c = self._split(xbc)
        dt = F.softplus(dt + self.dt_bias).clamp(self.dt_limit[0], self.dt_limit[1])
        y, new_ssm = ssd_scan(
            x.reshape(t, self.num_heads, self.head_dim).float(),
            dt,
            self.A,
            b.reshape(t, self.n_groups, self.d_state),
            c.reshape(t, self.n_groups, self.d_state),
            self.D,
            ssm,
            min(self.chunk_size, SCAN_BLOCK),
        )
        return self._finish(y.reshape(t, self.intermediate), z, dtype, False), new_conv, new_ssm

    # --- decode: a tile of requests, one token each -------------------------------------
    def step(
        self, h: Tensor, conv: Tensor, ssm: Tensor, fresh: Tensor | None, *, invariant: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`h` [R, hidden], one token of each of R rows (the first n = len(ssm) requests, then
        padding); `conv` [n, C, K-1], `ssm` [n, H, P, N]. `fresh` [R] marks requests with no token
        computed yet (None: none): transformers runs their first token through the chunked form,
        which clamps dt to `dt_limit`, so they are clamped alike. Returns the output [R, hidden] and the n
        requests' new states (`ssm`, the caller's own copy, updated in place; conv [n, C, K-1]).

        The per-head work (projections, SiLU, dt, exp) runs on all R rows: its shapes are the
        stack's. The conv's products and sums and the state update, the large part, run on the n
        real rows only: products and sums, exact elementwise whatever the shape, and a sum over
        K or N per output."""
        r, n, dtype = h.shape[0], ssm.shape[0], h.dtype
        z, window, x, b, c, dt = self._step_inputs(h, conv, fresh, invariant)
        b, c = self._per_head(b, r), self._per_head(c, r)
        decay = torch.exp(dt.float() * self.A)[:n, :, None, None]
        # state * decay + (dt * B) x, in place in this step's own copy of the blocks' state. In
        # fp32 the product [n, H, P, N] is not materialised; in 16-bit it is rounded to the
        # compute dtype before the add, as transformers does.
        dtb, new_ssm = (dt[:n, :, None] * b[:n])[:, :, None, :], ssm.mul_(decay)
        if dtype == torch.float32:
            new_ssm.addcmul_(dtb, x[:n, :, :, None])
        else:
            new_ssm.add_(dtb * x[:n, :, :, None])
        y = torch.zeros_like(x)
        y[:n] = (new_ssm.to(dtype) * c[:n, :, None, :]).sum(-1) + x[:n] * self.D[:, None]
        return self._finish(y.reshape(r, self.intermediate), z, dtype, invariant), window[:, :, 1:], new_ssm

    def step_in_pages(
        self,
        h: Tensor,
        conv_pages: Tensor,
        ssm_pages: Tensor,
        page_ids: Tensor,
        fresh: Tensor | None,
        kernels: tuple[ConvStepKernel, Mamba2StateKernel],
        *,
        invariant: bool,
    ) -> Tensor:
        """`step` for an fp32 model with the states in their pages (request i's in page
        `page_ids[i]` of `conv_pages` [pages, C, K-1] and `ssm_pages` [pages, H, P, N]), both
        moved on there in place by the C kernels (conv_kernel.py, mamba2_kernel.py): the conv in
        `step`'s order, the recurrence in the kernel's (last bits apart from `step`'s). Returns
        the output [R, hidden]."""
        r, n = h.shape[0], page_ids.shape[0]
        if h.dtype != torch.float32:
            raise ValueError(f"the Mamba2 kernels compute fp32 models only, not {h.dtype}")
        conv_kernel, state_kernel = kernels
        z, xbc, dt = self._project(h, invariant)
        mixed = xbc.new_zeros(xbc.shape)  # zero after the requests' rows, as conv_step's
        conv_kernel(conv_pages, page_ids, xbc[:n], self.conv_weight, self.conv_bias, mixed[:n])
        x, b, c, dt = self._after_conv(mixed, dt, fresh)
        groups = (n, self.n_groups, self.d_state)
        y = torch.zeros_like(x)
        state_kernel(
            ssm_pages,
            page_ids,
            torch.exp(dt * self.A)[:n],  # on every row, as the torch path: a stack's shape (tiles.py)
            dt[:n].contiguous(),
            x[:n].contiguous(),
            b[:n].reshape(groups).contiguous(),
            c[:n].reshape(groups).contiguous(),
            self.D.float().contiguous(),
            y[:n],
        )
        return self._finish(y.reshape(r, self.intermediate), z, h.dtype, invariant)

    def _step_inputs(
        self, h: Tensor, conv: Tensor, fresh: Tensor | None, invariant: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """A step's inputs to the recurrence: the gate z [R, I], the conv windows [n, C, K], x
        [R, H, P], B and C per group [R, G * N] and dt [R, H]."""
        r, n, dtype = h.shape[0], conv.shape[0], h.dtype
        z, xbc, dt = self._project(h, invariant)
        window = torch.cat([conv.to(dtype), xbc[:n, :, None]], dim=2)  # [n, C, K]
        x, b, c, dt = self._after_conv(conv_step(window, self.conv_weight, self.conv_bias, r), dt, fresh)
        return z, window, x, b, c, dt

    def _after_conv(self, mixed: Tensor, dt: Tensor, fresh: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """From the conv's output [R, C] and the raw dt [R, H] of a step: x [R, H, P], B and C
        per group [R, G * N] and dt [R, H]."""
        x, b, c = self._split(F.silu(mixed))
        dt = F.softplus(dt + self.dt_bias)  # [R, H]; a step does not clamp (as transformers)
        if fresh is not None and self.dt_limit != NO_DT_LIMIT:  # softplus is >= 0: (0, inf) clamps nothing
            dt = torch.where(fresh[:, None], dt.clamp(self.dt_limit[0], self.dt_limit[1]), dt)
        return x.reshape(mixed.shape[0], self.num_heads, self.head_dim), b, c, dt

    def _per_head(self, t: Tensor, rows: int) -> Tensor:
        """[rows, G * N] -> [rows, H, N]: each head gets its group's vector."""
        rep = self.num_heads // self.n_groups
        g = t.reshape(rows, self.n_groups, 1, self.d_state).expand(rows, self.n_groups, rep, self.d_state)
        return g.reshape(rows, self.num_heads, self.d_state)


def ssd_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, state: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """The chunked SSD form of the Mamba2 recurrence for one request, in fp32.

    x [T, H, P], dt [T, H], A [H], B and C [T, G, N] (per group: head h reads group
    h // (H // G)), D [H], state [H, P, N] entering the first token. Returns y [T, H, P] (D skip
    included) and the state after the last token. Within a chunk the output is a masked,
    decay-weighted matmul; between chunks the state carries over by its total decay.

    Everything runs head-major ([H, chunks, L, ...], contiguous), so every product is a plain
    batched matmul over whole matrices and nothing is copied through strided views; C B^T is
    taken once per group, not per head."""
    t, heads, p = x.shape
    groups, n = B.shape[1], B.shape[2]
    rep = heads // groups
    count = -(-t // chunk)
    dth = _head_major(dt, count * chunk).view(heads, count, chunk)
    a = dth * A[:, None, None]  # [H, c, L] log-decays
    xh = _head_major(x, count * chunk).view(heads, count, chunk, p)
    xd = xh * dth[..., None]
    bg = _head_major(B, count * chunk).view(groups, count, chunk, n)
    cg = _head_major(C, count * chunk).view(groups, count, chunk, n)
    cum = torch.cumsum(a, dim=-1)  # [H, c, L]
    # decay from position j to position i (j <= i) inside a chunk: exp(sum_{j < r <= i} a_r)
    scores = _segment_decay(a).view(groups, rep, count, chunk, chunk)
    scores.mul_(torch.matmul(cg, bg.transpose(-1, -2))[:, None])  # (C_i . B_j) decay(j -> i)
    y = torch.matmul(scores.view(heads, count, chunk, chunk), xd)  # [H, c, L, P]: within each chunk
    to_end = torch.exp(cum[..., -1:] - cum)  # [H, c, L]
    local = torch.matmul((xd * to_end[..., None]).transpose(-1, -2), _per_head(bg, rep))  # [H, c, P, N]
    total = torch.exp(cum[..., -1])  # [H, c]
    starts = torch.empty_like(local)  # the state entering each chunk
    s = state.to(torch.float32)
    for i in range(count):
        starts[:, i] = s
        s = total[:, i, None, None] * s + local[:, i]
    y.addcmul_(torch.matmul(_per_head(cg, rep), starts.transpose(-1, -2)), torch.exp(cum)[..., None])
    y.addcmul_(xh, D.float()[:, None, None, None])  # the D skip
    return y.view(heads, count * chunk, p)[:, :t].transpose(0, 1), s  # [T, H, P]


def _head_major(v: Tensor, rows: int) -> Tensor:
    """[T, H, ...] -> [H, rows, ...] in fp32, contiguous, zero after token T (padding tokens have
    dt = 0: decay 1 and no input, so they leave the state as it was)."""
    out = v.new_zeros((v.shape[1], rows, *v.shape[2:]), dtype=torch.float32)
    out[:, : v.shape[0]] = v.transpose(0, 1)
    return out


def _per_head(g: Tensor, rep: int) -> Tensor:
    """[G, ...] -> [G * rep, ...]: each head its group's tensor."""
    return g[:, None].expand(g.shape[0], rep, *g.shape[1:]).reshape(g.shape[0] * rep, *g.shape[1:])


def _segment_decay(a: Tensor) -> Tensor:
    """[..., L] -> [..., L, L]: out[..., i, j] = exp(sum_{j < r <= i} a[r]) for j <= i, 0 above.
    The sums are cumulative sums of the masked log-decays (never a difference of two cumulative
    sums, which would lose the small ones next to large ones)."""
    length = a.shape[-1]
    expanded = a[..., None].expand(*a.shape, length)  # [..., r, j] = a[r]
    strict = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    summed = torch.cumsum(expanded.masked_fill(~strict, 0), dim=-2)
    above = torch.triu(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=1)
    return summed.exp_().masked_fill_(above, 0.0)
