"""What a hybrid model is, as far as its cached state goes: layer kinds, dims, state dtypes.

A `ModelSpec` is the single description every other part reads: the layout math derives
per-rank shapes and pages from it, the reference engine builds its layers from it, and the
handshake compares its fingerprint. Pure data: no torch, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from itertools import pairwise
from typing import Literal

Family = Literal["mamba1", "mamba2", "gdn"]
DType = Literal["bf16", "fp16", "fp8", "fp32"]
LayerKind = Literal["attention", "ssm", "parallel", "mlp"]
"""Per layer: `attention` keeps K/V, `ssm` keeps conv + SSM state, `parallel` keeps both
(Falcon-H1: attention and Mamba2 side by side in one layer), `mlp` keeps nothing."""

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
DTYPES: tuple[DType, ...] = ("bf16", "fp16", "fp8", "fp32")


class LayoutError(ValueError):
    """Invalid model description or layout request; the message names the key or rule."""


@dataclass(frozen=True)
class AttentionDims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: bool = True


@dataclass(frozen=True)
class Mamba2Dims:
    num_heads: int  # H
    head_dim: int  # P; I = H * P
    n_groups: int  # G
    d_state: int  # N
    conv_kernel: int = 4  # K
    family: Family = field(default="mamba2", init=False)

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class GDNDims:
    num_k_heads: int  # Hk
    num_v_heads: int  # Hv
    head_k_dim: int  # Dk
    head_v_dim: int  # Dv
    conv_kernel: int = 4
    family: Family = field(default="gdn", init=False)


@dataclass(frozen=True)
class Mamba1Dims:
    d_inner: int  # D = expand * hidden
    d_state: int  # N
    dt_rank: int
    conv_kernel: int = 4
    family: Family = field(default="mamba1", init=False)


SSMDims = Mamba2Dims | GDNDims | Mamba1Dims


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str  # HF model_type, or "reference" for the tiny seeded models
    layer_kinds: tuple[LayerKind, ...]
    hidden_size: int
    vocab_size: int
    attention: AttentionDims
    ssm: SSMDims
    kv_dtype: DType = "bf16"
    conv_dtype: DType = "bf16"
    ssm_dtype: DType = "bf16"
    intermediate_size: int = 0  # MLP width (reference engine); 0 when irrelevant
    num_spec_tokens: int = 0  # extra conv rows for speculative decoding (0: off)
    # Digest of the checkpoint (config content and weights) an engine serves; empty for specs
    # that name no weights (presets, a bare config.json). Computed outside this package.
    checkpoint_digest: str = ""

    @property
    def family(self) -> Family:
        return self.ssm.family

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    # Cached (the spec is frozen): every request asks, through num_prefill_tokens, several times.
    @cached_property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in ("attention", "parallel"))

    @cached_property
    def ssm_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in ("ssm", "parallel"))

    def with_dtypes(self, kv: DType | None = None, conv: DType | None = None, ssm: DType | None = None) -> ModelSpec:
        return replace(
            self,
            kv_dtype=kv or self.kv_dtype,
            conv_dtype=conv or self.conv_dtype,
            ssm_dtype=ssm or self.ssm_dtype,
        )

    def with_checkpoint(self, digest: str) -> ModelSpec:
        return replace(self, checkpoint_digest=digest)

    def fingerprint(self) -> str:
        """SHA-256 over everything that shapes the cached bytes (not TP, not block sizes).

        With a checkpoint digest the weights identify the model and the display name is left
        out; without one the key is left out, so preset fingerprints never changed."""
        fields = asdict(self) | {"family": self.family}
        if self.checkpoint_digest:
            del fields["name"]
        else:
            del fields["checkpoint_digest"]
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def check_layer_range(num_layers: int, layers: range) -> None:
    """Raise `LayoutError` unless `layers` is a contiguous, non-empty range of the model's layers
    (what a layer part of a pipelined transfer covers)."""
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= num_layers:
        raise LayoutError(
            f"layers {layers}: must be a non-empty range of step 1 within the model's {num_layers} layers [0, {num_layers})"
        )


def layer_ranges(num_layers: int, parts: int) -> list[range]:
    """`range(num_layers)` cut into `parts` contiguous ranges whose lengths differ by at most one
    (the first ones the longer): the layer parts of a pipelined transfer, in order."""
    if not 1 <= parts <= num_layers:
        raise LayoutError(f"layer parts {parts}: must be in [1, {num_layers}] (one layer at least per part)")
    size, longer = divmod(num_layers, parts)
    edges = [part * size + min(part, longer) for part in range(parts + 1)]
    return [range(start, stop) for start, stop in pairwise(edges)]


def regions_in_layers(region_layers: Sequence[int], layers: range) -> slice:
    """The regions of a KV-cache group (`region_layers[j]`: the layer in region j, increasing, as
    the layout groups them) whose layer is in `layers`: one contiguous slice, since a range of
    increasing numbers is. Bisection: a group has few regions, and every request asks."""
    return slice(bisect_left(region_layers, layers.start), bisect_left(region_layers, layers.stop))
