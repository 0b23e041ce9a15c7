"""transformers' cache <-> the project's canonical (global, unsharded) state, both directions.

Conventions that differ, converted here and nowhere else:
- K/V: transformers `[1, kv_heads, T, head_dim]`; ours `[T, kv_heads, head_dim]` (token-major,
  as the paged store writes them).
- conv state: transformers keeps the last `conv_kernel` raw conv inputs per channel
  (`[1, C, K]`, oldest to newest); our layout keeps `K - 1` (as vLLM): the next step shifts the
  oldest column out before it convolves, so it never enters a result. Rebuilding puts a zero
  column in its place.
- GDN recurrent state: transformers `[1, Hv, Dk, Dv]` (key-major); ours `(Hv, Dv, Dk)`.
  Mamba2 `(H, P, N)` and Mamba1 `(D, N)` agree.
Tensors keep the dtype they were produced in (bf16 models keep fp32 recurrent states).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from shared.layout.spec import GDNDims, ModelSpec

# transformers keeps recurrent states in fp32 in every family, bf16 and fp16 models included.
RECURRENT_DTYPE = torch.float32


@dataclass
class HfState:
    """A request's state after `length` tokens, in our layouts (the paged store's tensors)."""

    length: int
    kv: dict[int, tuple[Tensor, Tensor]]  # layer -> (K, V), each [T, kv_heads, head_dim]
    ssm: dict[int, tuple[Tensor, Tensor]]  # layer -> (conv (C, K-1), recurrent state)


def _is_gdn(spec: ModelSpec) -> bool:
    return isinstance(spec.ssm, GDNDims)


def extract_state(cache: Any, spec: ModelSpec, length: int) -> HfState:
    """Copies (never views: transformers updates its states in place) of every layer's state."""
    kv: dict[int, tuple[Tensor, Tensor]] = {}
    for i in spec.attention_layers:
        layer = cache.layers[i]
        if layer.keys is None or layer.keys.shape[-2] != length:
            got = None if layer.keys is None else layer.keys.shape[-2]
            raise RuntimeError(f"layer {i}: transformers' cache holds K/V of {got} tokens, expected {length}")
        kv[i] = (layer.keys[0].transpose(0, 1).contiguous(), layer.values[0].transpose(0, 1).contiguous())
    return HfState(length=length, kv=kv, ssm=extract_ssm_state(cache, spec))


def extract_ssm_state(cache: Any, spec: ModelSpec) -> dict[int, tuple[Tensor, Tensor]]:
    """Copies of every SSM layer's (conv, recurrent) state, in our layouts."""
    return {i: extract_ssm_layer(cache, spec, i) for i in spec.ssm_layers}


def extract_ssm_layer(cache: Any, spec: ModelSpec, i: int) -> tuple[Tensor, Tensor]:
    """A copy of SSM layer i's (conv, recurrent) state, in our layouts."""
    conv, rec = cache.get_conv_state(i), cache.get_recurrent_state(i)
    if conv is None or rec is None:
        raise RuntimeError(f"layer {i}: transformers' cache holds no SSM state")
    if conv.shape[-1] != spec.ssm.conv_kernel:
        raise RuntimeError(f"layer {i}: conv state has {conv.shape[-1]} columns, the config says {spec.ssm.conv_kernel}")
    state = rec[0].transpose(-1, -2) if _is_gdn(spec) else rec[0]
    return conv[0, :, 1:].clone(), state.contiguous().clone()


def build_cache(config: Any, spec: ModelSpec, state: HfState) -> Any:
    """A fresh transformers cache holding `state`, ready for the next token (step mode).

    A state of 0 tokens gives an empty cache: the next forward then takes the prefill path, as
    generate() does for the first token."""
    from shared.logs.third_party import transformers_module

    cache: Any = transformers_module().DynamicCache(config=config)
    if state.length == 0:
        return cache
    for i, (k, v) in state.kv.items():
        cache.layers[i].update(k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous())
    for i, (conv, rec) in state.ssm.items():
        # Once per fresh layer: it allocates [1, C, K], copies and marks the layer as having a
        # previous state (without that the next token would silently restart from zero).
        full = torch.cat([torch.zeros_like(conv[:, :1]), conv], dim=-1).unsqueeze(0)
        cache.update_conv_state(full, i, conv_kernel_size=full.shape[-1])
        state_hf = rec.transpose(-1, -2) if _is_gdn(spec) else rec
        cache.update_recurrent_state(state_hf.unsqueeze(0).contiguous(), i)
    return cache
