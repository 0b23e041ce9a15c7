"""Service settings for prefill-svc and decode-svc: flags, then env `HYBRID_PD_<FLAG>`, then defaults.

Every flag can also come from the environment (`--num-blocks` <- `HYBRID_PD_NUM_BLOCKS`,
repeatable flags take a comma-separated list). A flag on the command line beats the
environment, which beats the default. Values are validated here, once, into a frozen
`ServiceSettings`; a bad value stops the process with a message naming the flag and where the
value came from.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from shared.config.flags import (
    DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS,
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_PORTS,
    DEFAULT_READ_TIMEOUT_SECONDS,
    ENV_PREFIX,
    FLAGS,
    Flag,
    Role,
    default_max_batched_tokens,
    flags_for,
)
from shared.config.parser import build_parser, other_service_flag


@dataclass(frozen=True)
class TlsSettings:
    """PEM files. cert+key turn TLS on (and are the certificate a client presents when asked);
    ca is the trust root clients check servers with (None: the system roots); client_ca makes
    servers demand client certificates signed by it (mutual TLS)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    client_ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None


@dataclass(frozen=True)
class ServiceSettings:
    role: Role
    model: str
    tp: int
    device: Literal["cpu", "cuda"]
    engine: Literal["synthetic", "reference", "hf", "paged"]  # --engine, or the one --model implies (default_engine)
    num_blocks: int | None  # logical blocks per engine (the same on every rank)
    memory_budget: int | None  # cache bytes per rank, when num_blocks is not given; neither: from the model
    block_size: int | None  # None: the smallest the hybrid page layout allows
    kernel_block_size: int
    host: str
    port: int
    engine_id: str
    lease_seconds: float
    heartbeat_seconds: float
    drain_seconds: float
    read_timeout_seconds: float
    max_pinned_requests: int
    metrics_port: int | None
    tls: TlsSettings
    loop: Literal["uvloop", "asyncio"]
    log_level: str
    log_format: Literal["text", "json"] = "text"
    prefill: tuple[str, ...] = field(default=())  # decode only: prefill peers, used round-robin
    kv_dtype: str | None = None  # None: the model's default
    conv_dtype: str | None = None
    ssm_dtype: str | None = None
    check_state: bool = False  # decode only: verify transferred state after every READ
    huge_pages: bool = True  # DRAM caches on transparent huge pages (shared/cache/host_memory.py)
    verify_transfer: bool = True  # digests of the transferred state: prefill sends, decode checks
    http_port: int | None = None  # OpenAI-compatible HTTP API (shared/http); None: off
    dtype: str | None = None  # --engine hf: compute dtype (None: the checkpoint's)
    batch_invariant: bool = True  # --engine paged: batches in fixed tiles (off: one GEMM, bits depend on the batch)
    native_kernels: bool = True  # --engine paged: the C kernels where they build (off: the torch path everywhere)
    discovery_seconds: float = 5.0  # decode only: re-resolve --prefill names this often (0: never)
    reconnect_max_seconds: float = 2.0  # decode only: cap of the reconnect backoff to a prefill
    advertise_address: str | None = None  # prefill only: HOST or HOST:PORT decode dials (P/D legs)
    engine_from_model: bool = False  # no --engine given: `engine` is what --model implies
    boundary: Literal["n-1", "full"] = "n-1"  # --boundary, or the engine's default (full for hf)
    prefill_chunk_tokens: int = 0  # prefill only: chunked prefill with manifest parts (0: off)
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS  # tokens one batched prefill step computes at most
    manifest_part_tokens: int = 0  # prefill only: the least tokens a part carries (0: one per chunk)
    layer_parts: int = 0  # prefill only: the last chunk's state in this many layer parts (0: one part)
    manifest_parts: bool = True  # decode only: accept manifest parts (pipelined transfer)
    stream_interval: int = 1  # decode only: tokens a stream coalesces before it sends (the first goes alone)
    # decode only: blocks the prefix cache may keep (0: off; None: the default share of the cache,
    # decided at start-up from the cache's size and the engine: decode_svc/reuse.py reuse_sizes)
    prefix_cache_blocks: int | None = None
    # decode only: state checkpoints kept (0: off; needs the prefix cache; None: sized from its blocks)
    prefix_cache_states: int | None = None
    # decode only: compute prompts here when no prefill is ready (share: also while prefill is busy)
    local_prefill: Literal["fallback", "share", "off"] = "fallback"
    local_prefill_below: int = 0  # decode only: prompts of fewer tokens are always computed here
    # decode only, share: the prompt tokens queued on the prefill engine before decode takes one
    local_prefill_queue_tokens: int = DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS
    decode_threads: int = 1  # decode only, paged engine: threads a step's tiles run on
    prefill_threads: int = 1  # prefill only, paged engine: threads a batched step's chunks run on
    served_model_names: tuple[str, ...] = ()  # HTTP `model` names; the first is listed. (): --model

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names HTTP requests may give as `model`; the first is the one /v1/models lists."""
        return self.served_model_names or (self.model,)

    @property
    def listen_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


class SettingsError(ValueError):
    """A flag or env value that fails validation; the message names the flag and the source."""


def _parse_value(flag: Flag, raw: str, source: str) -> object:
    """`source`: the environment variable the value came from, or "" for the command line."""
    try:
        return flag.parse(raw)
    except ValueError as e:
        where = f" (from {source})" if source else ""
        raise SettingsError(f"--{flag.name}{where} = {raw!r}: {e}") from None


# Variables of ours that are not flags: TEST-ONLY hooks, the test suite's switches (slow sweeps;
# CI, where a skip fails) and where made checkpoints are cached.
NOT_FLAGS = (
    "HYBRID_PD_TEST_PAUSE",
    "HYBRID_PD_TEST_CORRUPT",
    "HYBRID_PD_TEST_FAIL",
    "HYBRID_PD_SLOW",
    "HYBRID_PD_CI",
    "HYBRID_PD_CACHE",
)


def environment_warnings(role: Role, environ: Mapping[str, str]) -> list[str]:
    """One line per HYBRID_PD_* variable this service ignores: unknown names (a typo?) and the
    other service's flags."""
    own = {f.env for f in flags_for(role)}
    other: Role = "decode" if role == "prefill" else "prefill"
    theirs = {f.env for f in flags_for(other)} - own
    out = []
    for name in sorted(n for n in environ if n.startswith(ENV_PREFIX) and n not in own and n not in NOT_FLAGS):
        if name in theirs:
            out.append(f"{name} is a {other}-svc flag; {role}-svc ignores it")
        else:
            out.append(f"{name} is not a flag of {role}-svc (see --help); ignored")
    return out


def resolve(role: Role, args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[dict[str, object], dict[str, str]]:
    """Values by dest, and where each came from ("flag", "env" or "default")."""
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for flag in flags_for(role):
        given = getattr(args, flag.dest)
        if given is not None:
            raws = [p for g in given for p in (s.strip() for s in g.split(",")) if p] if flag.repeatable else [given]
            parsed = [_parse_value(flag, r, "") for r in raws]
            values[flag.dest] = tuple(parsed) if flag.repeatable else parsed[0]
            sources[flag.dest] = "flag"
        elif flag.env in environ and environ[flag.env].strip() != "":
            raw = environ[flag.env]
            if flag.repeatable:
                parts = [p for p in (s.strip() for s in raw.split(",")) if p]
                values[flag.dest] = tuple(_parse_value(flag, p, flag.env) for p in parts)
            else:
                values[flag.dest] = _parse_value(flag, raw, flag.env)
            sources[flag.dest] = "env"
        else:
            default = DEFAULT_PORTS[role] if flag.name == "port" else flag.default
            values[flag.dest] = () if flag.repeatable and default is None else default
            sources[flag.dest] = "default"
    return values, sources


def _cache_size(values: dict[str, object], sources: dict[str, str]) -> tuple[int | None, int | None]:
    """--num-blocks and --memory-budget exclude each other; a command-line value beats an env one."""
    blocks, budget = values["num_blocks"], values["memory_budget"]
    if blocks is not None and budget is not None:
        src_b, src_m = sources["num_blocks"], sources["memory_budget"]
        if src_b == src_m:
            where = "command line" if src_b == "flag" else "environment"
            raise SettingsError(f"--num-blocks and --memory-budget both given on the {where}; give one")
        if src_b == "flag":
            budget = None
        else:
            blocks = None
    assert blocks is None or isinstance(blocks, int)
    assert budget is None or isinstance(budget, int)
    return blocks, budget


T = TypeVar("T")


def _req(values: dict[str, object], key: str, kind: type[T]) -> T:
    value = values[key]
    assert isinstance(value, kind), (key, value)
    return value


def _opt(values: dict[str, object], key: str, kind: type[T]) -> T | None:
    value = values.get(key)
    return None if value is None else _req(values, key, kind)


def _own(values: dict[str, object], key: str, kind: type[T]) -> T:
    """A one-role flag's value; the other service (which has no such flag) gets its default."""
    if key in values:
        return _req(values, key, kind)
    default = next(f.default for f in FLAGS if f.dest == key)
    assert isinstance(default, kind), (key, default)
    return default


def _default_engine_id(role: Role) -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname().split(".")[0]) or "host"
    return f"{role}-{host}-{os.getpid()}"[:63]


EngineKind = Literal["synthetic", "reference", "hf", "paged"]
# Engines that run a checkpoint directory's weights (and sample in prefill at the full boundary).
CHECKPOINT_ENGINES: tuple[EngineKind, ...] = ("hf", "paged")


def default_engine(model: str) -> EngineKind:
    """The engine `--model` implies: a checkpoint directory runs its weights (paged where that
    engine computes the family, else hf), a tiny-* preset the reference model that matches it;
    anything else has no weights here, so its state is synthetic (byte patterns at the model's
    real sizes)."""
    from shared.engine.paged.support import paged_serves
    from shared.layout.presets import PRESETS

    path = Path(model).expanduser()
    if path.is_dir():
        return "paged" if paged_serves(str(path)) else "hf"
    preset = PRESETS.get(model)
    if preset is not None and preset.model_type == "reference":
        return "reference"
    return "synthetic"


def _engine(value: object, model: str) -> EngineKind:
    if value == "reference" or value == "hf" or value == "synthetic" or value == "paged":
        return value
    return default_engine(model)


def _boundary(value: object, source: str, engine: EngineKind) -> Literal["n-1", "full"]:
    """--boundary, or the engine's default: full where the engine samples in prefill (hf, paged)."""
    if value is None:
        return "full" if engine in CHECKPOINT_ENGINES else "n-1"
    if value == "full" and engine not in CHECKPOINT_ENGINES:
        where = " (from HYBRID_PD_BOUNDARY)" if source == "env" else ""
        raise SettingsError(f"--boundary{where} = 'full' needs --engine hf or paged; the {engine} engine runs n-1 only")
    return "full" if value == "full" else "n-1"


def _prefix_cache_states(values: dict[str, object]) -> int | None:
    """--prefix-cache-states, refused with the prefix cache it builds on turned off."""
    states = _opt(values, "prefix_cache_states", int)
    if states and _opt(values, "prefix_cache_blocks", int) == 0:
        raise SettingsError(
            "--prefix-cache-states needs the prefix cache (--prefix-cache-blocks is 0): a checkpoint's leading "
            "attention blocks come from the prefix cache"
        )
    return states


def _local_prefill(values: dict[str, object]) -> Literal["fallback", "share", "off"]:
    mode = _own(values, "local_prefill", str)
    return "off" if mode == "off" else "share" if mode == "share" else "fallback"


def _served_model_names(values: dict[str, object]) -> tuple[str, ...]:
    """--served-model-name, each name once, in the order given."""
    return tuple(dict.fromkeys(str(n) for n in _req(values, "served_model_name", tuple)))


def _needs_chunks(values: dict[str, object], name: str, why: str) -> int:
    """A prefill flag that shapes the parts of a prefill in chunks: refused without
    --prefill-chunk-tokens (`why` says what it does with them)."""
    value = _opt(values, name, int) or 0
    if value and not _opt(values, "prefill_chunk_tokens", int):
        raise SettingsError(f"--{name.replace('_', '-')} needs --prefill-chunk-tokens > 0: {why}")
    return value


def settings_from(role: Role, args: argparse.Namespace, environ: Mapping[str, str]) -> ServiceSettings:
    values, sources = resolve(role, args, environ)
    num_blocks, memory_budget = _cache_size(values, sources)
    tls = TlsSettings(
        cert=_opt(values, "tls_cert", Path),
        key=_opt(values, "tls_key", Path),
        ca=_opt(values, "tls_ca", Path),
        client_ca=_opt(values, "tls_client_ca", Path),
    )
    if (tls.cert is None) != (tls.key is None):
        raise SettingsError("--tls-cert and --tls-key go together; give both or neither")
    for name, given in (("--tls-ca", tls.ca), ("--tls-client-ca", tls.client_ca)):
        if given is not None and tls.cert is None:
            raise SettingsError(f"{name} needs --tls-cert and --tls-key too (the service's own identity)")
    # Without --prefill a decode engine serves only the decode leg of a P/D router (it learns
    # each prefill engine from the request's kv_transfer_params).
    prefill = tuple(str(p) for p in _req(values, "prefill", tuple)) if role == "decode" else ()
    engine = _engine(values["engine"], _req(values, "model", str))
    device: Literal["cpu", "cuda"] = "cuda" if values["device"] == "cuda" else "cpu"
    return ServiceSettings(
        role=role,
        model=_req(values, "model", str),
        tp=_req(values, "tp", int),
        device=device,
        engine=engine,
        engine_from_model=values["engine"] is None,
        boundary=_boundary(values["boundary"], sources["boundary"], engine),
        num_blocks=num_blocks,
        memory_budget=memory_budget,
        block_size=_opt(values, "block_size", int),
        kernel_block_size=_req(values, "kernel_block_size", int),
        host=_req(values, "host", str),
        port=_req(values, "port", int),
        engine_id=_opt(values, "engine_id", str) or _default_engine_id(role),
        lease_seconds=_own(values, "lease_seconds", float),
        heartbeat_seconds=_own(values, "heartbeat_seconds", float),
        drain_seconds=_req(values, "drain_seconds", float),
        read_timeout_seconds=_opt(values, "read_timeout_seconds", float) or DEFAULT_READ_TIMEOUT_SECONDS,
        max_pinned_requests=_req(values, "max_pinned_requests", int),
        metrics_port=_opt(values, "metrics_port", int),
        http_port=_opt(values, "http_port", int),
        tls=tls,
        loop="asyncio" if values["loop"] == "asyncio" else "uvloop",
        log_level=_req(values, "log_level", str),
        log_format="json" if values["log_format"] == "json" else "text",
        prefill=prefill,
        check_state=bool(values.get("check_state", False)),
        huge_pages=bool(values.get("huge_pages", True)),
        verify_transfer=values.get("verify_transfer", "digest") == "digest",
        discovery_seconds=_own(values, "discovery_seconds", float),
        prefix_cache_blocks=_opt(values, "prefix_cache_blocks", int),
        prefix_cache_states=_prefix_cache_states(values),
        local_prefill=_local_prefill(values),
        local_prefill_below=_own(values, "local_prefill_below", int),
        local_prefill_queue_tokens=_own(values, "local_prefill_queue_tokens", int),
        decode_threads=_own(values, "decode_threads", int),
        prefill_threads=_own(values, "prefill_threads", int),
        served_model_names=_served_model_names(values),
        reconnect_max_seconds=_own(values, "reconnect_max_seconds", float),
        advertise_address=_opt(values, "advertise_address", str) if role == "prefill" else None,
        prefill_chunk_tokens=(_opt(values, "prefill_chunk_tokens", int) or 0) if role == "prefill" else 0,
        max_batched_tokens=_opt(values, "max_batched_tokens", int) or default_max_batched_tokens(device),
        manifest_part_tokens=(
            _needs_chunks(values, "manifest_part_tokens", "parts leave only between the chunks a prefill computes")
            if role == "prefill"
            else 0
        ),
        layer_parts=(
            _needs_chunks(values, "layer_parts", "layer parts split the last chunk of a prefill in chunks")
            if role == "prefill"
            else 0
        ),
        manifest_parts=bool(values.get("manifest_parts", True)) if role == "decode" else True,
        stream_interval=_own(values, "stream_interval", int),
        batch_invariant=bool(values.get("batch_invariant", True)),
        native_kernels=bool(values.get("native_kernels", True)),
        kv_dtype=_opt(values, "kv_dtype", str),
        conv_dtype=_opt(values, "conv_dtype", str),
        ssm_dtype=_opt(values, "ssm_dtype", str),
        dtype=_opt(values, "dtype", str),
    )


def parse_settings(role: Role, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServiceSettings:
    """Parse argv + environment; on a bad value print usage and the reason, exit 2."""
    parser = build_parser(role)
    refused = other_service_flag(role, sys.argv[1:] if argv is None else argv)
    if refused is not None:
        parser.error(refused)
    args = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    for warning in environment_warnings(role, env):
        print(f"{parser.prog}: warning: {warning}", file=sys.stderr)
    try:
        return settings_from(role, args, env)
    except SettingsError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
