"""Handshake checks: is a layout message well formed, and can these two engines pair?

Three kinds of problems, all collected (never just the first):
- malformed message (missing ids, rank or region counts that do not add up) -> INVALID_ARGUMENT;
- the pair cannot exchange state (model, dtypes, conv layout, TP or kernel block sizes that do
  not divide, protocol version) -> FAILED_PRECONDITION;
- the peer's advertised geometry differs from what our layout math derives from its
  parameters (a peer running different layout code) -> FAILED_PRECONDITION.
Each problem names its field (`model.kv_dtype`, `ranks[1].page_bytes`) and both values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.message import Message

from shared.errors import FieldIssue, IncompatibleLayout, InvalidArgument
from shared.layout.compat import EngineFacts, handshake_issues
from shared.layout.page import EngineLayout
from shared.layout.plan import TransferPlan, build_plan
from shared.layout.spec import LayoutError, ModelSpec
from shared.pb.hybridpd.v1 import layout_pb2 as pb
from shared.runtime.layout_message import BOUNDARY_NAMES, rank_geometry, rebuild_layout
from shared.runtime.protocol_version import PROTOCOL_VERSION


def _enum_text(enum: Callable[[Any], str], value: int) -> str:
    name = enum(value)
    return name.split("_", 2)[-1].lower() if name.count("_") >= 2 else name


def facts_of(msg: pb.EngineLayout) -> EngineFacts:
    """What the pairing rules read, from an engine's layout message (enums by name)."""
    m = msg.model
    return EngineFacts(
        model_name=m.name,
        fingerprint=m.fingerprint,
        family=_enum_text(pb.SsmFamily.Name, m.family),
        kv_dtype=_enum_text(pb.DataType.Name, m.kv_dtype),
        conv_dtype=_enum_text(pb.DataType.Name, m.conv_dtype),
        ssm_dtype=_enum_text(pb.DataType.Name, m.ssm_dtype),
        num_layers=m.num_layers,
        num_spec_tokens=m.num_spec_tokens,
        vocab_size=m.vocab_size,
        num_regions=msg.num_regions,
        groups=tuple((_enum_text(pb.GroupKind.Name, g.kind), tuple(g.layer_indices)) for g in msg.groups),
        tp=msg.tp_size,
        kernel_block_size=msg.kernel_block_size,
        conv_layout=_enum_text(pb.ConvLayout.Name, msg.conv_layout),
        protocol_version=msg.protocol_version,
        engine_id=msg.engine_id,
        boundary=BOUNDARY_NAMES.get(msg.boundary, "unspecified"),
    )


def malformed_issues(msg: pb.EngineLayout, expected_role: int) -> list[FieldIssue]:
    """Structural problems of one message (field paths relative to the layout)."""
    issues: list[FieldIssue] = []

    def need(ok: bool, field: str, why: str) -> None:
        if not ok:
            issues.append(FieldIssue(field, why))

    need(msg.protocol_version > 0, "protocol_version", "must be set")
    need(bool(msg.engine_id), "engine_id", "must be non-empty")
    need(msg.incarnation != 0, "incarnation", "must be non-zero")
    need(
        msg.role == expected_role,
        "role",
        f"expected {pb.EngineRole.Name(expected_role)}, got {pb.EngineRole.Name(msg.role)}",  # type: ignore[arg-type]
    )
    need(bool(msg.model.fingerprint), "model.fingerprint", "must be non-empty")
    need(msg.tp_size >= 1, "tp_size", "must be >= 1")
    need(msg.kernel_block_size >= 1, "kernel_block_size", "must be >= 1")
    need(msg.physical_per_logical >= 1, "physical_per_logical", "must be >= 1")
    need(
        msg.block_size == msg.kernel_block_size * msg.physical_per_logical,
        "block_size",
        f"{msg.block_size} != kernel_block_size {msg.kernel_block_size} x physical_per_logical {msg.physical_per_logical}",
    )
    need(msg.num_logical_blocks >= 1, "num_logical_blocks", "must be >= 1")
    need(
        msg.num_physical_blocks == msg.num_logical_blocks * msg.physical_per_logical,
        "num_physical_blocks",
        f"{msg.num_physical_blocks} != num_logical_blocks x physical_per_logical",
    )
    need(msg.num_regions >= 1, "num_regions", "must be >= 1")
    need(msg.boundary != pb.BOUNDARY_UNSPECIFIED, "boundary", "must be set (n-1 or full)")
    need(
        msg.prefill_chunk_tokens == 0 or msg.role == pb.ENGINE_ROLE_PREFILL,
        "prefill_chunk_tokens",
        f"a prefill engine's flag: a decode engine sends 0, got {msg.prefill_chunk_tokens}",
    )
    need(len(msg.groups) >= 1, "groups", "must list the KV-cache groups")
    for g, group in enumerate(msg.groups):
        need(group.kind != pb.GROUP_KIND_UNSPECIFIED, f"groups[{g}].kind", "must be set")
        need(
            0 < len(group.layer_indices) <= msg.num_regions,
            f"groups[{g}].layer_indices",
            f"must have 1..{msg.num_regions} layers",
        )
    need(len(msg.ranks) == msg.tp_size, "ranks", f"{len(msg.ranks)} ranks for tp_size {msg.tp_size}")
    for r, rank in enumerate(msg.ranks):
        need(rank.tp_rank == r, f"ranks[{r}].tp_rank", f"is {rank.tp_rank}, expected {r} (ranks in order)")
        need(bool(rank.agent_name), f"ranks[{r}].agent_name", "must be non-empty")
        need(bool(rank.agent_metadata), f"ranks[{r}].agent_metadata", "must be non-empty")
        need(rank.device_type != pb.DEVICE_TYPE_UNSPECIFIED, f"ranks[{r}].device_type", "must be set")
        need(
            len(rank.region_base_addresses) == msg.num_regions,
            f"ranks[{r}].region_base_addresses",
            f"{len(rank.region_base_addresses)} addresses for {msg.num_regions} regions",
        )
    return issues


def pairing_issues(prefill: pb.EngineLayout, decode: pb.EngineLayout) -> list[FieldIssue]:
    """Every field that keeps this prefill/decode pair from exchanging state (the rules:
    `shared.layout.compat.handshake_issues`)."""
    issues = handshake_issues(facts_of(prefill), facts_of(decode), this_version=PROTOCOL_VERSION)
    return [FieldIssue(i.field, i.description) for i in issues]


def _fields(msg: Message) -> dict[str, object]:
    return {f.name: v for f, v in msg.ListFields()}


def derived_issues(msg: pb.EngineLayout, rebuilt: EngineLayout) -> list[FieldIssue]:
    """Advertised geometry that differs from what `rebuilt` (our math, its parameters) gives."""
    issues: list[FieldIssue] = []
    for name, ours in (
        ("physical_per_logical", rebuilt.physical_per_logical),
        ("num_regions", rebuilt.num_regions),
        ("num_physical_blocks", rebuilt.num_kernel_blocks(msg.num_logical_blocks)),
    ):
        theirs = getattr(msg, name)
        if theirs != ours:
            issues.append(FieldIssue(name, f"advertised {theirs}, derived {ours}"))
    want = _fields(rank_geometry(rebuilt, msg.num_logical_blocks))
    for r, rank in enumerate(msg.ranks):
        have = _fields(rank)
        for name, value in want.items():
            if have.get(name) != value:
                issues.append(
                    FieldIssue(f"ranks[{r}].{name}", "advertised value differs from the layout derived from its parameters")
                )
    return issues


def _prefixed(issues: list[FieldIssue], prefix: str) -> list[FieldIssue]:
    return [FieldIssue(f"{prefix}.{i.field}", i.description) for i in issues]


def check_pair(
    prefill: pb.EngineLayout,
    decode: pb.EngineLayout,
    *,
    local_role: str,
    local_layout: EngineLayout,
    spec: ModelSpec,
) -> TransferPlan:
    """Validate the peer's message, check the pair, and build the transfer plan.

    `local_role` says which of the two messages is ours (trusted); the other one is the peer's,
    received in `HandshakeRequest.layout` / `HandshakeResponse.layout`. Raises InvalidArgument
    (malformed peer message) or IncompatibleLayout (listing every field).
    """
    prefix = "layout"
    peer, peer_role = (decode, pb.ENGINE_ROLE_DECODE) if local_role == "prefill" else (prefill, pb.ENGINE_ROLE_PREFILL)
    bad = malformed_issues(peer, peer_role)
    if bad:
        raise InvalidArgument(
            f"malformed {prefix} ({len(bad)} problems): " + "; ".join(str(i) for i in _prefixed(bad, prefix)),
            issues=_prefixed(bad, prefix),
        )
    issues = pairing_issues(prefill, decode)
    if not issues:
        try:
            rebuilt = rebuild_layout(peer, spec)
        except LayoutError as e:
            issues.append(FieldIssue("block_size", f"peer parameters give no valid layout: {e}"))
        else:
            issues += derived_issues(peer, rebuilt)
    if issues:
        raise IncompatibleLayout(
            f"incompatible prefill/decode pair ({len(issues)} fields): " + "; ".join(str(i) for i in issues),
            issues=issues,
        )
    prefill_layout, decode_layout = (local_layout, rebuilt) if local_role == "prefill" else (rebuilt, local_layout)
    try:
        return build_plan(prefill_layout, decode_layout)
    except LayoutError as e:
        raise IncompatibleLayout(f"no transfer plan for this pair: {e}", issues=[FieldIssue("plan", str(e))]) from e
