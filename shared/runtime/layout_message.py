"""`shared.layout.EngineLayout` + per-rank memory facts <-> the `hybridpd.v1.EngineLayout` message.

The message is what a peer learns at handshake. Everything in it that follows from the model
and a few parameters (page sizes, sections, ratios) is also recomputed by the receiver from
those parameters (`rebuild_layout`) and compared, so a peer whose layout math disagrees with
ours is refused before any byte moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.spec import LayoutError, ModelSpec
from shared.pb.hybridpd.v1 import layout_pb2 as pb
from shared.runtime.protocol_version import PROTOCOL_VERSION

DATA_TYPES: dict[str, int] = {
    "bf16": pb.DATA_TYPE_BF16,
    "fp16": pb.DATA_TYPE_FP16,
    "fp8": pb.DATA_TYPE_FP8,
    "fp32": pb.DATA_TYPE_FP32,
}
FAMILIES: dict[str, int] = {
    "mamba1": pb.SSM_FAMILY_MAMBA1,
    "mamba2": pb.SSM_FAMILY_MAMBA2,
    "gdn": pb.SSM_FAMILY_GDN,
}
GROUP_KINDS: dict[str, int] = {"attention": pb.GROUP_KIND_ATTENTION, "mamba": pb.GROUP_KIND_MAMBA}
ROLES: dict[str, int] = {"prefill": pb.ENGINE_ROLE_PREFILL, "decode": pb.ENGINE_ROLE_DECODE}
DEVICE_TYPES: dict[str, int] = {"cpu": pb.DEVICE_TYPE_CPU, "cuda": pb.DEVICE_TYPE_CUDA}
BOUNDARIES: dict[str, int] = {"n-1": pb.BOUNDARY_N_MINUS_1, "full": pb.BOUNDARY_FULL}
BOUNDARY_NAMES: dict[int, str] = {v: k for k, v in BOUNDARIES.items()}


@dataclass(frozen=True)
class RankMemory:
    """What only the running rank knows: its agent and where its regions are."""

    agent_name: str
    agent_metadata: bytes
    device_type: str  # "cpu" | "cuda"
    device_id: int
    region_base_addresses: tuple[int, ...]


def model_identity(spec: ModelSpec) -> pb.ModelIdentity:
    return pb.ModelIdentity(
        name=spec.name,
        fingerprint=spec.fingerprint(),
        family=FAMILIES[spec.family],  # type: ignore[arg-type]
        kv_dtype=DATA_TYPES[spec.kv_dtype],  # type: ignore[arg-type]
        conv_dtype=DATA_TYPES[spec.conv_dtype],  # type: ignore[arg-type]
        ssm_dtype=DATA_TYPES[spec.ssm_dtype],  # type: ignore[arg-type]
        num_layers=spec.num_layers,
        num_spec_tokens=spec.num_spec_tokens,
        vocab_size=spec.vocab_size,
    )


def rank_geometry(layout: EngineLayout, num_logical_blocks: int) -> pb.RankLayout:
    """The derived (address-free) part of a rank's message; identical for every rank of an engine."""
    s = layout.shapes
    return pb.RankLayout(
        region_size_bytes=layout.region_bytes(num_logical_blocks),
        page_bytes=layout.page_bytes,
        kernel_page_bytes=layout.kernel_page_bytes,
        kv_heads=s.kv_heads_per_rank,
        conv_bytes=s.conv_bytes,
        ssm_bytes=s.ssm_bytes,
        conv_sections=[
            pb.ConvSection(name=name, offset_bytes=offset, size_bytes=size, dim=dim)
            for name, offset, size, dim in zip(s.section_names, s.section_offsets, s.section_bytes, s.section_dims)
        ],
        ssm_state_dims=list(s.ssm_shape),
    )


def engine_layout_message(
    layout: EngineLayout,
    *,
    role: str,
    engine_id: str,
    incarnation: int,
    num_logical_blocks: int,
    ranks: Sequence[RankMemory],
    boundary: str = "n-1",
    prefill_chunk_tokens: int = 0,
) -> pb.EngineLayout:
    """`boundary`: the engine's (--boundary), which its peer must share. `prefill_chunk_tokens`:
    the chunks a prefill engine computes in (--prefill-chunk-tokens; 0: one forward), which
    decode's prefix cache needs to know what K/V of a prefix it may reuse."""
    msg = pb.EngineLayout(
        protocol_version=PROTOCOL_VERSION,
        engine_id=engine_id,
        incarnation=incarnation,
        role=ROLES[role],  # type: ignore[arg-type]
        model=model_identity(layout.spec),
        conv_layout=pb.CONV_LAYOUT_DS,
        tp_size=layout.tp,
        block_size=layout.block_size,
        kernel_block_size=layout.kernel_block_size,
        physical_per_logical=layout.physical_per_logical,
        block_alignment=layout.alignment,
        num_logical_blocks=num_logical_blocks,
        num_physical_blocks=layout.num_kernel_blocks(num_logical_blocks),
        num_regions=layout.num_regions,
        boundary=BOUNDARIES[boundary],  # type: ignore[arg-type]
        prefill_chunk_tokens=prefill_chunk_tokens,
        groups=[
            pb.CacheGroup(kind=GROUP_KINDS[g.kind], layer_indices=list(g.layers))  # type: ignore[arg-type]
            for g in layout.groups
        ],
    )
    for rank, mem in enumerate(ranks):
        rank_msg = msg.ranks.add()
        rank_msg.CopyFrom(rank_geometry(layout, num_logical_blocks))
        rank_msg.tp_rank = rank
        rank_msg.agent_name = mem.agent_name
        rank_msg.agent_metadata = mem.agent_metadata
        rank_msg.device_type = DEVICE_TYPES[mem.device_type]  # type: ignore[assignment]
        rank_msg.device_id = mem.device_id
        rank_msg.region_base_addresses.extend(mem.region_base_addresses)
    return msg


def rebuild_layout(msg: pb.EngineLayout, spec: ModelSpec) -> EngineLayout:
    """The peer's `EngineLayout`, recomputed from its parameters with our model spec.

    Only meaningful when the peer runs the same model (fingerprints equal); `LayoutError` if
    the parameters are not a layout our math can produce.
    """
    layout = build_engine_layout(
        spec,
        msg.tp_size,
        block_size=msg.block_size,
        kernel_block_size=msg.kernel_block_size,
        alignment=msg.block_alignment,
    )
    if layout.block_size != msg.block_size:
        raise LayoutError(f"block size {msg.block_size} is below the minimum {layout.min_block_size} for TP {msg.tp_size}")
    return layout
