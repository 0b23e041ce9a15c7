"""Per-rank state shapes and the index functions that define tensor-parallel sharding.

The index functions are the single source of truth for how a global (unsharded) state is
stored across TP ranks. Everything else (plans, the cache, the reference engine's
shard/unshard with `index_select`/`index_copy`) derives from them:

- `conv_channel_index(spec, tp, r)`: global conv channel of each local conv row. The conv state
  is stored DS, `(conv_dim, conv_rows)`, with its sections (`[x|B|C]`, `[q|k|v]`, `[x]`) each
  cut into contiguous pieces; rank r holds its piece of every section, concatenated. A section
  cut into `k` pieces gives rank r piece `r * k // tp`: `k == tp` shards it, `k < tp` replicates
  each piece on `tp / k` adjacent ranks. Only Mamba2 B and C have `k < tp`: they are cut into
  `min(n_groups, tp)` pieces of whole groups, so with `tp` a multiple of `n_groups` each group is
  replicated on the `tp / n_groups` ranks whose heads use it, and `n_groups == 1` keeps B and C
  whole on every rank. This is vLLM's convention (`extra_groups_for_head_shards` widens the
  groups to `tp`, and the weight loader gives rank r group `r // (tp / n_groups)`), so a rank
  stores `[x_r | B_g | C_g]`, `I/tp + 2N` channels.
- `ssm_row_index(spec, tp, r)`: global index along the SSM state's first axis (Mamba2 heads,
  GDN value heads, Mamba1 channels); a contiguous slice per rank.
- `kv_head_index(spec, tp, r)`: KV heads held; sharded when `tp <= KV`, otherwise rank r holds
  the single head `floor(r * KV / tp)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.layout.spec import DTYPE_BYTES, Family, GDNDims, LayoutError, Mamba1Dims, Mamba2Dims, ModelSpec

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ConvSection:
    """One conv sub-projection in global channel space."""

    name: str
    start: int  # first global channel
    size: int  # global channels
    pieces: int  # distinct contiguous pieces across ranks: tp (sharded) or fewer (replicated)

    def piece_of(self, tp: int, rank: int) -> int:
        """The piece rank `rank` of `tp` holds (adjacent ranks share a replicated piece)."""
        return rank * self.pieces // tp


@dataclass(frozen=True)
class RankShapes:
    """What one TP rank stores for one layer (FA: per token; SSM: per request)."""

    tp: int
    family: Family
    head_dim: int
    kv_dtype_bytes: int
    conv_dtype_bytes: int
    ssm_dtype_bytes: int
    kv_heads_per_rank: int
    kv_replicated: bool
    conv_rows: int  # conv window kept per channel: K - 1 (+ speculative tokens for Mamba2/GDN)
    conv_dim: int  # local conv channels (rows of the DS conv state)
    section_names: tuple[str, ...]
    section_dims: tuple[int, ...]  # local channels per section
    section_sharded: tuple[bool, ...]  # False: the section is replicated on several ranks
    section_replicas: tuple[int, ...]  # ranks holding each piece of the section (1: sharded)
    section_bytes: tuple[int, ...]
    section_offsets: tuple[int, ...]  # byte offset of each section inside the conv state
    conv_bytes: int
    ssm_shape: tuple[int, ...]
    ssm_bytes: int
    fa_bytes_per_token: int  # K and V of one token of one FA layer

    @property
    def conv_row_bytes(self) -> int:
        return self.conv_rows * self.conv_dtype_bytes

    @property
    def ssm_row_bytes(self) -> int:
        return self.ssm_bytes // self.ssm_shape[0]

    @property
    def mamba_bytes(self) -> int:
        """Real bytes of one SSM layer's state (conv + SSM), before HMA padding."""
        return self.conv_bytes + self.ssm_bytes

    # The one home of the Mamba page's byte offsets (DS layout): the conv state first, its
    # sections consecutive, then the SSM state, then padding up to the page size.
    @property
    def conv_offset(self) -> int:
        """Page offset of the conv state."""
        return 0

    @property
    def ssm_offset(self) -> int:
        """Page offset of the SSM state: right after the conv state."""
        return self.conv_offset + self.conv_bytes

    @property
    def piece_offsets(self) -> tuple[int, ...]:
        """Page offset of every Mamba piece: each conv section, then the SSM state."""
        return (*(self.conv_offset + o for o in self.section_offsets), self.ssm_offset)

    @property
    def num_sections(self) -> int:
        return len(self.section_names)


def conv_sections(spec: ModelSpec, tp: int = 1) -> tuple[ConvSection, ...]:
    """The conv sections of the global state, in storage order."""
    ssm = spec.ssm
    if isinstance(ssm, Mamba2Dims):
        bc = ssm.n_groups * ssm.d_state
        groups = min(ssm.n_groups, tp)  # pieces of whole groups (check_tp: one divides the other)
        return (
            ConvSection("x", 0, ssm.intermediate, tp),
            ConvSection("B", ssm.intermediate, bc, groups),
            ConvSection("C", ssm.intermediate + bc, bc, groups),
        )
    if isinstance(ssm, GDNDims):
        key = ssm.num_k_heads * ssm.head_k_dim
        value = ssm.num_v_heads * ssm.head_v_dim
        return (
            ConvSection("q", 0, key, tp),
            ConvSection("k", key, key, tp),
            ConvSection("v", 2 * key, value, tp),
        )
    return (ConvSection("x", 0, ssm.d_inner, tp),)


def global_conv_dim(spec: ModelSpec) -> int:
    return sum(s.size for s in conv_sections(spec))


def conv_rows(spec: ModelSpec) -> int:
    # vLLM adds speculative rows to Mamba2/GDN conv windows only.
    extra = 0 if isinstance(spec.ssm, Mamba1Dims) else spec.num_spec_tokens
    return spec.ssm.conv_kernel - 1 + extra


def global_ssm_shape(spec: ModelSpec) -> tuple[int, ...]:
    ssm = spec.ssm
    if isinstance(ssm, Mamba2Dims):
        return (ssm.num_heads, ssm.head_dim, ssm.d_state)
    if isinstance(ssm, GDNDims):
        return (ssm.num_v_heads, ssm.head_v_dim, ssm.head_k_dim)  # current vLLM orientation (Dv, Dk)
    return (ssm.d_inner, ssm.d_state)


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Raise `LayoutError` naming the first divisibility rule `tp` breaks."""
    if tp < 1:
        raise LayoutError(f"TP size must be >= 1, got {tp}")
    att, ssm = spec.attention, spec.ssm
    rules: list[tuple[bool, str]] = [
        (att.num_heads % tp == 0, f"query heads {att.num_heads} % tp {tp} != 0"),
        (
            att.num_kv_heads % tp == 0 if tp <= att.num_kv_heads else tp % att.num_kv_heads == 0,
            f"KV heads {att.num_kv_heads}: need KV % tp == 0 (sharded) or tp % KV == 0 (replicated), tp {tp}",
        ),
    ]
    if isinstance(ssm, Mamba2Dims):
        rules += [
            (ssm.num_heads % tp == 0, f"SSM heads {ssm.num_heads} % tp {tp} != 0"),
            (
                ssm.n_groups % tp == 0 or tp % ssm.n_groups == 0,
                f"SSM groups {ssm.n_groups}: need n_groups % tp == 0 (sharded) or tp % n_groups == 0 "
                f"(each group replicated on tp / n_groups ranks), tp {tp}",
            ),
        ]
    elif isinstance(ssm, GDNDims):
        rules += [
            (ssm.num_k_heads % tp == 0, f"GDN key heads {ssm.num_k_heads} % tp {tp} != 0"),
            (ssm.num_v_heads % tp == 0, f"GDN value heads {ssm.num_v_heads} % tp {tp} != 0"),
        ]
    else:
        rules.append((ssm.d_inner % tp == 0, f"Mamba1 channels {ssm.d_inner} % tp {tp} != 0"))
    for ok, why in rules:
        if not ok:
            raise LayoutError(f"{spec.name}: TP {tp} is invalid: {why}")


def valid_tp(spec: ModelSpec, tp: int) -> bool:
    try:
        check_tp(spec, tp)
    except LayoutError:
        return False
    return True


def rank_shapes(spec: ModelSpec, tp: int) -> RankShapes:
    check_tp(spec, tp)
    att = spec.attention
    kv_heads = max(1, att.num_kv_heads // tp)
    sections = conv_sections(spec, tp)
    rows = conv_rows(spec)
    conv_b, ssm_b, kv_b = DTYPE_BYTES[spec.conv_dtype], DTYPE_BYTES[spec.ssm_dtype], DTYPE_BYTES[spec.kv_dtype]
    dims = tuple(s.size // s.pieces for s in sections)
    section_bytes = tuple(d * rows * conv_b for d in dims)
    offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(section_bytes)[:-1]]))
    gshape = global_ssm_shape(spec)
    ssm_shape = (gshape[0] // tp, *gshape[1:])
    return RankShapes(
        tp=tp,
        family=spec.family,
        head_dim=att.head_dim,
        kv_dtype_bytes=kv_b,
        conv_dtype_bytes=conv_b,
        ssm_dtype_bytes=ssm_b,
        kv_heads_per_rank=kv_heads,
        kv_replicated=tp > att.num_kv_heads,
        conv_rows=rows,
        conv_dim=sum(dims),
        section_names=tuple(s.name for s in sections),
        section_dims=dims,
        section_sharded=tuple(s.pieces == tp for s in sections),
        section_replicas=tuple(tp // s.pieces for s in sections),
        section_bytes=section_bytes,
        section_offsets=offsets,
        conv_bytes=sum(section_bytes),
        ssm_shape=ssm_shape,
        ssm_bytes=int(np.prod(ssm_shape)) * ssm_b,
        fa_bytes_per_token=2 * kv_heads * att.head_dim * kv_b,
    )


def _check_rank(spec: ModelSpec, tp: int, rank: int) -> None:
    check_tp(spec, tp)
    if not 0 <= rank < tp:
        raise LayoutError(f"rank {rank} is outside TP {tp}")


def conv_channel_index(spec: ModelSpec, tp: int, rank: int) -> IntArray:
    """Global conv channel of each local conv row of `rank` (length `conv_dim`)."""
    _check_rank(spec, tp, rank)
    parts = []
    for s in conv_sections(spec, tp):
        n, piece = s.size // s.pieces, s.piece_of(tp, rank)
        parts.append(np.arange(s.start + piece * n, s.start + (piece + 1) * n, dtype=np.int64))
    return np.concatenate(parts)


def ssm_row_index(spec: ModelSpec, tp: int, rank: int) -> IntArray:
    """Global index along the SSM state's first axis of each local row of `rank`."""
    _check_rank(spec, tp, rank)
    n = global_ssm_shape(spec)[0] // tp
    return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)


def kv_head_index(spec: ModelSpec, tp: int, rank: int) -> IntArray:
    """Global KV heads held by `rank`, in storage order."""
    _check_rank(spec, tp, rank)
    kv = spec.attention.num_kv_heads
    if tp <= kv:
        n = kv // tp
        return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)
    return np.array([rank * kv // tp], dtype=np.int64)
