"""Where the engine keeps a request's state: one protocol, one dense in-process implementation.

The model never owns memory. Every step reads and writes state through a `StateStore`, so the
same math runs on the dense store below (colocated runs, tests) and on a paged, TP-sharded cache
(the services gather the shards on read and scatter them on write). All tensors crossing this
boundary are GLOBAL (unsharded) and fp32, in the engine's canonical layouts:

- K/V per attention layer: `[length, num_kv_heads, head_dim]`, token-ordered.
- conv state per SSM layer: DS layout `(conv_dim, K-1)`, time index 0 = oldest raw conv input,
  channel sections `[x|B|C]` (Mamba2), `[q|k|v]` (GDN) or `[x]` (Mamba1).
- SSM state per SSM layer: `(H, P, N)` (Mamba2), `(Hv, Dv, Dk)` (GDN, vLLM orientation) or
  `(D, N)` (Mamba1).

`layer` is always the model layer index (0-based, as in `ModelSpec.layer_kinds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from shared.layout.spec import GDNDims, Mamba1Dims, Mamba2Dims, ModelSpec


class StateStore(Protocol):
    def write_kv(self, layer: int, pos: int, k: Tensor, v: Tensor) -> None:
        """Store K and V (each `[num_kv_heads, head_dim]`) of token position `pos`."""
        ...

    def read_kv(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        """K and V of positions `0..length-1`, each `[length, num_kv_heads, head_dim]`."""
        ...

    def read_ssm(self, layer: int) -> tuple[Tensor, Tensor]:
        """(conv state, SSM state) after the last computed token; zeros for a new request."""
        ...

    def write_ssm(self, layer: int, conv: Tensor, ssm: Tensor) -> None:
        """Replace the layer's (conv, SSM) state. The store may keep the tensors it is given:
        the engine never modifies a tensor after writing it or after reading it."""
        ...


def conv_sections(spec: ModelSpec) -> tuple[tuple[str, int], ...]:
    """Named channel sections of the global conv state, in storage order."""
    d = spec.ssm
    if isinstance(d, Mamba2Dims):
        gn = d.n_groups * d.d_state
        return (("x", d.intermediate), ("B", gn), ("C", gn))
    if isinstance(d, GDNDims):
        key = d.num_k_heads * d.head_k_dim
        return (("q", key), ("k", key), ("v", d.num_v_heads * d.head_v_dim))
    return (("x", d.d_inner),)


def conv_state_shape(spec: ModelSpec) -> tuple[int, int]:
    _require_no_spec_tokens(spec)
    return (sum(n for _, n in conv_sections(spec)), spec.ssm.conv_kernel - 1)


def ssm_state_shape(spec: ModelSpec) -> tuple[int, ...]:
    d = spec.ssm
    if isinstance(d, Mamba2Dims):
        return (d.num_heads, d.head_dim, d.d_state)
    if isinstance(d, GDNDims):
        return (d.num_v_heads, d.head_v_dim, d.head_k_dim)
    assert isinstance(d, Mamba1Dims)
    return (d.d_inner, d.d_state)


def _require_no_spec_tokens(spec: ModelSpec) -> None:
    if spec.num_spec_tokens:
        raise ValueError("the reference engine does not support speculative decoding (num_spec_tokens must be 0)")


class DenseStateStore:
    """One request's state in plain device tensors (colocated runs and tests).

    K/V live in a growing buffer per attention layer; `read_kv` returns a contiguous prefix
    view of it, so no per-step copy is made.
    """

    def __init__(self, spec: ModelSpec, device: torch.device | str = "cpu", capacity: int = 64) -> None:
        self.spec = spec
        self.device = torch.device(device)
        kv_shape = (spec.attention.num_kv_heads, spec.attention.head_dim)
        self._kv: dict[int, Tensor] = {
            i: torch.zeros((2, max(1, capacity), *kv_shape), device=self.device) for i in spec.attention_layers
        }
        conv_shape, ssm_shape = conv_state_shape(spec), ssm_state_shape(spec)
        self._ssm: dict[int, tuple[Tensor, Tensor]] = {
            i: (torch.zeros(conv_shape, device=self.device), torch.zeros(ssm_shape, device=self.device)) for i in spec.ssm_layers
        }

    def write_kv(self, layer: int, pos: int, k: Tensor, v: Tensor) -> None:
        buf = self._kv[layer]
        if pos >= buf.shape[1]:
            grown = torch.zeros((2, max(2 * buf.shape[1], pos + 1), *buf.shape[2:]), device=self.device)
            grown[:, : buf.shape[1]] = buf
            self._kv[layer] = buf = grown
        buf[0, pos] = k
        buf[1, pos] = v

    def read_kv(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        buf = self._kv[layer]
        return buf[0, :length], buf[1, :length]

    def read_ssm(self, layer: int) -> tuple[Tensor, Tensor]:
        return self._ssm[layer]

    def write_ssm(self, layer: int, conv: Tensor, ssm: Tensor) -> None:
        self._ssm[layer] = (conv, ssm)


@dataclass
class GlobalState:
    """A request's full state after `length` tokens, detached from any store (for comparisons,
    for seeding another store, and for the byte-equality check after a transfer)."""

    length: int
    kv: dict[int, tuple[Tensor, Tensor]]
    ssm: dict[int, tuple[Tensor, Tensor]]

    def equal(self, other: GlobalState) -> bool:
        """Bitwise equality (NaN-safe: compares bytes, not values)."""
        if self.length != other.length or self.kv.keys() != other.kv.keys() or self.ssm.keys() != other.ssm.keys():
            return False
        pairs = [(a, b) for i in self.kv for a, b in zip(self.kv[i], other.kv[i])]
        pairs += [(a, b) for i in self.ssm for a, b in zip(self.ssm[i], other.ssm[i])]
        return all(_bytes_equal(a, b) for a, b in pairs)


def _bytes_equal(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(ab, bb))


def read_global_state(store: StateStore, spec: ModelSpec, length: int) -> GlobalState:
    """Copy every layer's state out of `store` (any implementation) after `length` tokens."""
    kv: dict[int, tuple[Tensor, Tensor]] = {}
    for i in spec.attention_layers:
        k, v = store.read_kv(i, length)
        kv[i] = (k.clone(), v.clone())
    ssm: dict[int, tuple[Tensor, Tensor]] = {}
    for i in spec.ssm_layers:
        conv, state = store.read_ssm(i)
        ssm[i] = (conv.clone(), state.clone())
    return GlobalState(length=length, kv=kv, ssm=ssm)


def write_global_state(store: StateStore, state: GlobalState) -> None:
    """Load a snapshot into `store` (e.g. a fresh store standing in for the decode side)."""
    for layer, (k, v) in state.kv.items():
        for pos in range(state.length):
            store.write_kv(layer, pos, k[pos].clone(), v[pos].clone())
    for layer, (conv, ssm) in state.ssm.items():
        store.write_ssm(layer, conv.clone(), ssm.clone())
