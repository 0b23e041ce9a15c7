"""The decoder stack: a forward of chunks (one or many requests, many tokens each) or a decode
step of a tile of requests over one token each, reading and writing state only through the paged blocks.

A layer is a list of sublayers, each `h = h + scale * mixer(norm(h))`; a mixer is attention,
a Mamba2 mixer, an MLP or a mixture of experts (families.py builds them from a checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from shared.engine.paged.attention import Attention
from shared.engine.paged.attention_kernel import attention_kernel, blocks_of
from shared.engine.paged.chunk_attention import causal_chunk_attention
from shared.engine.paged.conv_kernel import ConvStepKernel, conv_step_kernel
from shared.engine.paged.ffn import Mlp, Moe
from shared.engine.paged.gdn import GatedDeltaNet
from shared.engine.paged.mamba1 import Mamba1
from shared.engine.paged.mamba2 import Mamba2
from shared.engine.paged.mamba2_kernel import Mamba2StateKernel, mamba2_state_kernel
from shared.engine.paged.norms import rms_norm
from shared.engine.paged.tiles import linear, pad_rows, padding_after, stack_rows, tile_rows
from shared.engine.paged_state import (
    PagedStateStore,
    StepIndex,
    kv_pages,
    read_kv_heads,
    read_ssm_many,
    state_pages,
    write_kv_tokens,
    write_ssm_many,
)


@dataclass
class Parallel:
    """Falcon-H1: attention and Mamba2 side by side on the same normalised input, their scaled
    outputs summed."""

    attention: Attention
    mamba: Mamba2
    attn_in: float = 1.0
    attn_out: float = 1.0
    ssm_out: float = 1.0


Ssm = Mamba2 | Mamba1 | GatedDeltaNet
SSM_MIXERS = (Mamba2, Mamba1, GatedDeltaNet)
Mixer = Attention | Mamba2 | Mamba1 | GatedDeltaNet | Mlp | Moe | Parallel


def _scaled(x: Tensor, scale: float) -> Tensor:
    return x * scale if scale != 1.0 else x


# Per SSM layer: (conv [C, K-1], SSM state), a prefill run's state between its chunks.
SsmStates = dict[int, tuple[Tensor, Tensor]]


@dataclass
class ChunkInput:
    """One request's chunk in a forward of chunks (`Model.forward_chunks`): tokens `ids` at
    positions start.., K/V of earlier positions read from `store` and the new ones written
    there, SSM layers starting from `carried` (None: the blocks' state, zero at start 0) and,
    with `write_ssm`, storing their final state; `on_layer(i)` follows layer i once its bytes
    are final."""

    ids: Sequence[int]
    start: int
    store: PagedStateStore
    carried: SsmStates | None
    write_ssm: bool
    on_layer: Callable[[int], None] | None = None
    keep_rows: bool = False  # also the logits of every token (prompt logprobs)


@dataclass
class ChunkOutput:
    """A chunk's logits of its last token, its SSM states after it, and (`keep_rows`) the
    logits of each of its tokens."""

    logits: Tensor
    states: SsmStates
    rows: Tensor | None = None


@dataclass
class Norm:
    weight: Tensor
    eps: float
    weight_in_fp32: bool = False
    offset: float = 0.0  # Qwen3-Next / Qwen3.5 scale by 1 + weight

    def __call__(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, weight_in_fp32=self.weight_in_fp32, offset=self.offset)


@dataclass
class Sublayer:
    norm: Norm
    mixer: Mixer
    scale: float = 1.0  # Granite's residual_multiplier


@dataclass
class Layer:
    sublayers: list[Sublayer]


@dataclass
class Model:
    GEMM_WEIGHTS: ClassVar[tuple[str, ...]] = ("lm_head",)

    family: str
    dtype: torch.dtype
    device: torch.device
    embed: Tensor
    layers: list[Layer]
    final_norm: Norm
    lm_head: Tensor
    embed_scale: float = 1.0
    logits_divisor: float = 1.0  # Granite's logits_scaling
    logits_scale: float = 1.0  # Falcon-H1's lm_head_multiplier
    conv_shape: dict[int, tuple[int, int]] = field(default_factory=dict)  # SSM layer -> conv state shape

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    def _embed(self, ids: Tensor) -> Tensor:
        h = self.embed[ids]
        return h * self.embed_scale if self.embed_scale != 1.0 else h

    def _logits(self, h: Tensor, *, invariant: bool) -> Tensor:
        logits = linear(self.final_norm(h), self.lm_head, invariant=invariant)
        if self.logits_scale != 1.0:
            logits = logits * self.logits_scale
        return logits / self.logits_divisor if self.logits_divisor != 1.0 else logits

    # --- many requests, a chunk of tokens each ------------------------------------------
    def forward_chunks(self, chunks: Sequence[ChunkInput], *, invariant: bool) -> list[ChunkOutput]:
        """Every chunk in one forward: logits of each chunk's last token and its SSM states after
        it (a prefill's chunks, or a decode session's restored prompt tail, alone or together).

        The chunks' rows are stacked; every row-wise op (norms, projections, MLPs, experts) runs
        once over the stack, attention and the SSM scans per chunk on the chunk's own rows. With
        `invariant`, each chunk starts on a whole tile and the stack is padded to whole stacks
        (tiles.stack_rows), so the GEMMs (tiles.linear) see only whole tiles and every row-wise
        kernel runs each element through its vector loop: a chunk's bits do not depend on the
        other chunks (nor on whether it has any). Without it the chunks are packed and each GEMM
        is one call (the negative control)."""
        if not chunks:
            return []
        starts: list[int] = []
        rows = 0
        for c in chunks:
            if not c.ids:
                raise ValueError("forward_chunks: a chunk has no tokens")
            starts.append(rows)
            rows += tile_rows(len(c.ids)) if invariant else len(c.ids)
        total = stack_rows(rows, self.dtype) if invariant else rows
        token_ids = torch.zeros(total, dtype=torch.long, device=self.device)
        positions = torch.zeros(total, dtype=torch.long, device=self.device)
        spans: list[slice] = []
        for c, at in zip(chunks, starts):
            t = len(c.ids)
            token_ids[at : at + t] = torch.tensor(list(c.ids), dtype=torch.long, device=self.device)
            positions[at : at + t] = torch.arange(c.start, c.start + t, dtype=torch.long, device=self.device)
            spans.append(slice(at, at + t))
        with padding_after(rows, total):
            h, states = self._forward_stack(token_ids, positions, chunks, spans, invariant)
        last = torch.tensor([s.stop - 1 for s in spans], dtype=torch.long, device=self.device)
        if invariant:  # the last rows again as a stack of their own, padding after them
            ends_rows = stack_rows(len(chunks), self.dtype)
            with padding_after(len(chunks), ends_rows):
                logits = self._logits(pad_rows(h[last], ends_rows), invariant=True)
        else:
            logits = self._logits(h[last], invariant=False)
        # A chunk's every-token logits from its own rows only: the same shapes alone or not.
        return [
            ChunkOutput(logits[i], states[i], self._logits(h[rows], invariant=False) if c.keep_rows else None)
            for i, (c, rows) in enumerate(zip(chunks, spans))
        ]

    def _forward_stack(
        self, token_ids: Tensor, positions: Tensor, chunks: Sequence[ChunkInput], spans: Sequence[slice], invariant: bool
    ) -> tuple[Tensor, list[SsmStates]]:
        """The stack's last hidden states and each chunk's SSM states after it."""
        h = self._embed(token_ids)
        states: list[SsmStates] = [{} for _ in chunks]
        for index, layer in enumerate(self.layers):
            for sub in layer.sublayers:
                x = sub.norm(h)
                mixer = sub.mixer
                if isinstance(mixer, Attention):
                    y = self._attend_chunks(mixer, index, x, positions, chunks, spans, invariant)
                elif isinstance(mixer, SSM_MIXERS):
                    y = self._mamba_chunks(mixer, index, x, chunks, spans, states)
                elif isinstance(mixer, Parallel):
                    ssm_y = self._mamba_chunks(mixer.mamba, index, x, chunks, spans, states)
                    attn_y = self._attend_chunks(
                        mixer.attention, index, _scaled(x, mixer.attn_in), positions, chunks, spans, invariant
                    )
                    y = _scaled(ssm_y, mixer.ssm_out) + _scaled(attn_y, mixer.attn_out)
                else:
                    y = mixer(x, invariant=invariant)
                h = h + y * sub.scale if sub.scale != 1.0 else h + y
            for c in chunks:
                if c.on_layer is not None:
                    c.on_layer(index)
        return h, states

    def _attend_chunks(
        self,
        mixer: Attention,
        index: int,
        x: Tensor,
        positions: Tensor,
        chunks: Sequence[ChunkInput],
        spans: Sequence[slice],
        invariant: bool,
    ) -> Tensor:
        q, k, v, gate = mixer.qkv(x, positions, invariant=invariant)
        attn = q.new_zeros((x.shape[0], mixer.num_heads * mixer.head_dim))
        for c, rows in zip(chunks, spans):
            kc, vc = k[rows], v[rows]
            c.store.write_kv_range(index, c.start, kc, vc)
            if c.start:
                past_k, past_v = c.store.read_kv_as(index, c.start, self.dtype)
                kc, vc = torch.cat([past_k, kc]), torch.cat([past_v, vc])
            attn[rows] = causal_chunk_attention(q[rows], kc, vc, c.start, mixer.scaling)
        return mixer.output(attn, gate, invariant=invariant)

    def _mamba_chunks(
        self, mixer: Ssm, index: int, x: Tensor, chunks: Sequence[ChunkInput], spans: Sequence[slice], states: list[SsmStates]
    ) -> Tensor:
        """Each chunk's scan on its own rows: the same shapes alone or beside others."""
        y = x.new_zeros(x.shape)
        for c, rows, out in zip(chunks, spans, states):
            y[rows] = self._mamba_sequence(mixer, index, x[rows], c.start, c.store, c.carried, out, c.write_ssm)
        return y

    def _mamba_sequence(
        self,
        mixer: Ssm,
        index: int,
        x: Tensor,
        start: int,
        store: PagedStateStore,
        carried: SsmStates | None,
        states: SsmStates,
        write_ssm: bool,
    ) -> Tensor:
        conv, ssm = self._initial_ssm(index, start, store, carried)
        y, conv, ssm = mixer.prefill(x, conv, ssm)
        states[index] = (conv, ssm)
        if write_ssm:
            store.write_ssm(index, conv, ssm)
        return y

    def _initial_ssm(self, layer: int, start: int, store: PagedStateStore, carried: SsmStates | None) -> tuple[Tensor, Tensor]:
        if carried is not None and layer in carried:
            return carried[layer]
        if carried is None and start:
            conv, ssm = read_ssm_many([store], layer, self.dtype, torch.float32)
            return conv[0], ssm[0]
        conv_shape, ssm_shape = self.conv_shape[layer], self._ssm_shape(layer)
        return (
            torch.zeros(conv_shape, dtype=self.dtype, device=self.device),
            torch.zeros(ssm_shape, dtype=torch.float32, device=self.device),
        )

    def _ssm_shape(self, layer: int) -> tuple[int, ...]:
        for sub in self.layers[layer].sublayers:
            mixer = sub.mixer.mamba if isinstance(sub.mixer, Parallel) else sub.mixer
            if isinstance(mixer, SSM_MIXERS):
                return mixer.state_shape
        raise ValueError(f"layer {layer} has no SSM mixer")

    # --- many requests, one token each --------------------------------------------------
    def forward_step(
        self,
        ids: Sequence[int],
        stores: Sequence[PagedStateStore],
        positions: Sequence[int],
        *,
        rows: int,
        invariant: bool,
        native: bool = True,
    ) -> Tensor:
        """One token of each request (`ids[b]` at `positions[b]`, state in `stores[b]`), computed
        on `rows` rows (the requests, then zero padding): logits `[len(ids), vocab]`.

        Every op but attention (and the mixers' products and sums on the requests' own rows)
        runs on the whole `[rows, ...]` tensors; attention runs per request on its own K/V. With
        `invariant` and `rows` whole stacks (tiles.stack_rows), or whole units of this model's
        step (stack_unit.py), a request's bits cannot depend on the other rows. `native`: an fp32
        model on a CPU runs its Mamba2 conv and state updates and attention through the C kernels
        where they build (conv_kernel.py, mamba2_kernel.py, attention_kernel.py); False: the
        torch path everywhere."""
        with padding_after(len(ids), rows):
            return self._step_stack(ids, stores, positions, rows, invariant, native)

    def _step_stack(
        self,
        ids: Sequence[int],
        stores: Sequence[PagedStateStore],
        positions: Sequence[int],
        rows: int,
        invariant: bool,
        native: bool,
    ) -> Tensor:
        n = len(ids)
        token_ids = pad_rows(torch.tensor(list(ids), dtype=torch.long, device=self.device), rows)
        pos = pad_rows(torch.tensor(list(positions), dtype=torch.long, device=self.device), rows)
        h = self._embed(token_ids)
        fresh = pos == 0 if 0 in positions else None  # requests with no token computed yet
        lookups = StepIndex()  # block tables looked up once per group, not per layer
        for index, layer in enumerate(self.layers):
            for sub in layer.sublayers:
                x = sub.norm(h)
                mixer = sub.mixer
                if isinstance(mixer, Attention):
                    y = self._attend_step(mixer, index, x, pos, stores, positions, invariant, native, lookups)
                elif isinstance(mixer, SSM_MIXERS):
                    y = self._mamba_step(mixer, index, x, fresh, stores, invariant, native, lookups)
                elif isinstance(mixer, Parallel):
                    ssm_y = self._mamba_step(mixer.mamba, index, x, fresh, stores, invariant, native, lookups)
                    attn_y = self._attend_step(
                        mixer.attention, index, _scaled(x, mixer.attn_in), pos, stores, positions, invariant, native, lookups
                    )
                    y = _scaled(ssm_y, mixer.ssm_out) + _scaled(attn_y, mixer.attn_out)
                else:
                    y = mixer(x, invariant=invariant)
                h = h + y * sub.scale if sub.scale != 1.0 else h + y
        return self._logits(h, invariant=invariant)[:n]

    def _attend_step(
        self,
        mixer: Attention,
        index: int,
        x: Tensor,
        pos: Tensor,
        stores: Sequence[PagedStateStore],
        positions: Sequence[int],
        invariant: bool,
        native: bool,
        lookups: StepIndex,
    ) -> Tensor:
        """The new tokens' K/V go to the blocks; each request then attends over its own K/V:
        read where it lies by the C kernel (fp32 on a CPU, `native`), else read back from the
        blocks into spans for the torch path."""
        n, rows = len(stores), x.shape[0]
        q, k, v, gate = mixer.qkv(x, pos, invariant=invariant)
        write_kv_tokens(stores, index, positions, k[:n], v[:n], lookups)
        lengths = [p + 1 for p in positions]
        kernel = attention_kernel() if self._kernels_apply(native) else None
        pages = kv_pages(stores, index, lookups) if kernel is not None else None
        if kernel is None:
            attn = mixer.attend_tokens(q, read_kv_heads(stores, index, lengths, self.dtype, lookups))
        elif pages is not None:  # K/V read where they lie
            lay = stores[0].layout
            attn = mixer.attend_in_pages(
                q, *pages, torch.tensor(lengths), kernel, block_size=lay.block_size, kernels_per_block=lay.physical_per_logical
            )
        else:  # heads split over ranks: the kernel on gathered copies laid out as blocks, the same bits
            fa, table, size = blocks_of(read_kv_heads(stores, index, lengths, self.dtype, lookups))
            attn = mixer.attend_in_pages(q, fa, table, torch.tensor(lengths), kernel, block_size=size, kernels_per_block=1)
        return mixer.output(pad_rows(attn, rows), gate, invariant=invariant)

    def _mamba_step(
        self,
        mixer: Ssm,
        index: int,
        x: Tensor,
        fresh: Tensor | None,
        stores: Sequence[PagedStateStore],
        invariant: bool,
        native: bool,
        lookups: StepIndex,
    ) -> Tensor:
        kernels = self._mamba2_kernels(native) if isinstance(mixer, Mamba2) else None
        pages = state_pages(stores, index, lookups) if kernels is not None else None
        if kernels is not None and pages is not None:  # the states moved on in their pages
            assert isinstance(mixer, Mamba2)
            return mixer.step_in_pages(x, *pages, fresh, kernels, invariant=invariant)
        conv, ssm = read_ssm_many(stores, index, self.dtype, torch.float32, lookups)
        if kernels is not None:  # states split over ranks: the kernels on gathered copies, the same bits
            assert isinstance(mixer, Mamba2)
            y = mixer.step_in_pages(x, conv, ssm, torch.arange(len(stores)), fresh, kernels, invariant=invariant)
        else:
            y, conv, ssm = mixer.step(x, conv, ssm, fresh, invariant=invariant)
        write_ssm_many(stores, index, conv, ssm, lookups)
        return y

    def _mamba2_kernels(self, native: bool) -> tuple[ConvStepKernel, Mamba2StateKernel] | None:
        """The Mamba2 step's C kernels where they apply and build (both, or the torch path)."""
        if not self._kernels_apply(native):
            return None
        conv, state = conv_step_kernel(), mamba2_state_kernel()
        return None if conv is None or state is None else (conv, state)

    def _kernels_apply(self, native: bool) -> bool:
        """Whether this model's decode steps run the C kernels: asked for, fp32, on a CPU."""
        return native and self.dtype == torch.float32 and self.device.type == "cpu"
