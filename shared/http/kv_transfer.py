"""vLLM's P/D `kv_transfer_params` (connector metadata as routers pass it through), pure.

Prefill leg (router -> prefill): `{"do_remote_decode": true, "do_remote_prefill": false,
"remote_*": null}`. Prefill's answer and the decode leg (router -> decode) carry
`{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id", "remote_request_id",
"remote_host", "remote_port", "remote_block_ids": [[...] per KV-cache group], "tp_size", ...}`.
Our own fields ride inside under `"hybrid_pd"` (the explicit N-1 boundary, the prefill
incarnation, the transfer id a decode engine claims the pinned state by). Types are checked exactly (an integer field given as 1.0 or true is an
error, not a silent conversion): a router that mangles them must fail loudly, naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidArgument

ROOT = "kv_transfer_params"
EXTRA = "hybrid_pd"
EXTRA_VERSION = 1


@dataclass(frozen=True)
class RemotePrefill:
    """The decode leg's instructions: which prefill engine holds the state, and where."""

    engine_id: str
    request_id: str
    host: str
    port: int  # prefill's gRPC port (Handshake and Session)
    block_ids: tuple[tuple[int, ...], ...]  # one tuple per KV-cache group, prefill's logical ids
    tp_size: int = 1
    num_tokens: int | None = None  # prompt tokens the state covers (vLLM's remote_num_tokens)
    expiry_time: float | None = None  # wall-clock seconds since the epoch
    num_computed_tokens: int | None = None  # ours: the N-1 boundary (state covers prompt[:N-1])
    incarnation: str | None = None  # ours: the prefill process's incarnation, hex
    transfer_id: str | None = None  # ours: what the READ notifications carry; the claim names it

    @property
    def grpc_target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


def _name(*path: str | int) -> str:
    out = ROOT
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidArgument(f"must be true or false, got {value!r}", field=_name(key))
    return value


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Prefill leg: True when the router asks this prefill to compute and pin for a remote decode."""
    if params is None:
        return False
    decode, prefill = _flag(params, "do_remote_decode"), _flag(params, "do_remote_prefill")
    if decode and prefill:
        raise InvalidArgument("do_remote_decode and do_remote_prefill cannot both be true", field=_name("do_remote_prefill"))
    return decode


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """Decode leg: True when the state was computed by the prefill engine the params name."""
    if params is None:
        return False
    decode, prefill = _flag(params, "do_remote_decode"), _flag(params, "do_remote_prefill")
    if decode and prefill:
        raise InvalidArgument("do_remote_decode and do_remote_prefill cannot both be true", field=_name("do_remote_prefill"))
    return prefill


def _str(params: Mapping[str, Any], key: str, *path: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"must be a non-empty string, got {value!r}", field=_name(*path, key))
    return value


def _int(
    params: Mapping[str, Any], key: str, *path: str, low: int, high: int | None = None, default: int | None = None
) -> int | None:
    value = params.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise InvalidArgument(f"must be an integer, got {value!r} ({type(value).__name__})", field=_name(*path, key))
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidArgument(f"must be {bound}, got {value}", field=_name(*path, key))
    return int(value)


def _block_ids(value: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list) or not value:
        raise InvalidArgument(
            "must be a non-empty list with one list of block ids per KV-cache group", field=_name("remote_block_ids")
        )
    groups = []
    for g, ids in enumerate(value):
        if not isinstance(ids, list):
            raise InvalidArgument(
                "must be a list of block ids (one list per group, never flattened)", field=_name("remote_block_ids", g)
            )
        for i, block in enumerate(ids):
            if not _is_int(block) or block < 0:
                raise InvalidArgument(f"must be an integer >= 0, got {block!r}", field=_name("remote_block_ids", g, i))
        groups.append(tuple(int(b) for b in ids))
    return tuple(groups)


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """The decode leg's params, every field type-checked; problems name the field."""
    if not wants_remote_prefill(params):
        raise InvalidArgument("must be true for a decode of remotely prefilled state", field=_name("do_remote_prefill"))
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and (isinstance(expiry, bool) or not isinstance(expiry, (int, float)) or not math.isfinite(expiry)):
        raise InvalidArgument(
            f"must be a number (seconds since the epoch), got {expiry!r}", field=_name("remote_blocks_expiry_time")
        )
    for key in ("dcp_size", "pp_size"):
        if _int(params, key, low=1, default=1) != 1:
            raise InvalidArgument("only 1 is supported", field=_name(key))
    extra = params.get(EXTRA)
    if extra is not None and not isinstance(extra, dict):
        raise InvalidArgument("must be an object", field=_name(EXTRA))
    extra = extra or {}
    version = _int(extra, "version", EXTRA, low=1, default=EXTRA_VERSION)
    if version != EXTRA_VERSION:
        raise InvalidArgument(
            f"version {version} is not understood (this engine speaks {EXTRA_VERSION})", field=_name(EXTRA, "version")
        )
    incarnation = extra.get("incarnation")
    if incarnation is not None and not isinstance(incarnation, str):
        raise InvalidArgument("must be a hex string", field=_name(EXTRA, "incarnation"))
    transfer_id = extra.get("transfer_id")
    if transfer_id is not None and (not isinstance(transfer_id, str) or not transfer_id):
        raise InvalidArgument("must be a non-empty string", field=_name(EXTRA, "transfer_id"))
    tp_size = _int(params, "tp_size", low=1, default=1)
    assert tp_size is not None
    port = _int(params, "remote_port", low=1, high=65535)
    if port is None:
        raise InvalidArgument("is required (the prefill engine's gRPC port)", field=_name("remote_port"))
    num_tokens = _int(params, "remote_num_tokens", low=1)
    computed = _int(extra, "num_computed_tokens", EXTRA, low=0)
    if computed is not None and num_tokens is not None and computed >= num_tokens:
        raise InvalidArgument(
            f"{computed} computed tokens for a {num_tokens}-token prompt; the state must stop before the last prompt token",
            field=_name(EXTRA, "num_computed_tokens"),
        )
    return RemotePrefill(
        engine_id=_str(params, "remote_engine_id"),
        request_id=_str(params, "remote_request_id"),
        host=_str(params, "remote_host"),
        port=port,
        block_ids=_block_ids(params.get("remote_block_ids")),
        tp_size=tp_size,
        num_tokens=num_tokens,
        expiry_time=None if expiry is None else float(expiry),
        num_computed_tokens=computed,
        incarnation=incarnation,
        transfer_id=transfer_id,
    )


@dataclass(frozen=True)
class PrefillGroups:
    """What the named prefill engine's layout says (from its handshake): to check the block ids."""

    num_logical_blocks: int
    group_names: Sequence[str] = field(default=())  # for messages; len() is the group count


def check_blocks(remote: RemotePrefill, groups: PrefillGroups) -> None:
    """Block ids that the named prefill engine can actually hold: one list per group, in range,
    no id twice within a group."""
    want = len(groups.group_names)
    if len(remote.block_ids) != want:
        raise InvalidArgument(
            f"{len(remote.block_ids)} groups of block ids; prefill {remote.engine_id} has {want} KV-cache groups",
            field=_name("remote_block_ids"),
        )
    for g, ids in enumerate(remote.block_ids):
        seen: set[int] = set()
        for i, block in enumerate(ids):
            if block >= groups.num_logical_blocks:
                raise InvalidArgument(
                    f"block {block} is out of range: prefill {remote.engine_id} has {groups.num_logical_blocks} blocks",
                    field=_name("remote_block_ids", g, i),
                )
            if block in seen:
                raise InvalidArgument(f"block {block} appears twice in group {g}", field=_name("remote_block_ids", g, i))
            seen.add(block)


def prefill_answer(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    block_ids: Sequence[Sequence[int]],
    tp_size: int,
    num_tokens: int,
    num_computed_tokens: int,
    expiry_time: float,
    incarnation: int,
    transfer_id: str | None = None,
) -> dict[str, Any]:
    """Prefill's `kv_transfer_params` answer, exact types (ints stay ints), ours under `hybrid_pd`."""
    extra: dict[str, Any] = {
        "version": EXTRA_VERSION,
        "num_computed_tokens": int(num_computed_tokens),
        "incarnation": f"{incarnation:016x}",
    }
    if transfer_id is not None:
        extra["transfer_id"] = transfer_id
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": int(port),
        "remote_block_ids": [[int(b) for b in ids] for ids in block_ids],
        "tp_size": int(tp_size),
        "remote_num_tokens": int(num_tokens),
        "remote_blocks_expiry_time": float(expiry_time),
        EXTRA: extra,
    }
