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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from shared.cache.cache_size import DEFAULT_MEMORY_FRACTION, DEFAULT_REQUEST_TOKENS, DEFAULT_REQUESTS
from shared.version import version

ENV_PREFIX = "HYBRID_PD_"
Role = Literal["prefill", "decode"]
DEFAULT_PORTS: dict[str, int] = {"prefill": 50051, "decode": 50052}
DEFAULT_READ_TIMEOUT_SECONDS = 10.0


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
    discovery_seconds: float = 5.0  # decode only: re-resolve --prefill names this often (0: never)
    reconnect_max_seconds: float = 2.0  # decode only: cap of the reconnect backoff to a prefill
    advertise_address: str | None = None  # prefill only: HOST or HOST:PORT decode dials (P/D legs)
    engine_from_model: bool = False  # no --engine given: `engine` is what --model implies
    boundary: Literal["n-1", "full"] = "n-1"  # --boundary, or the engine's default (full for hf)
    prefill_chunk_tokens: int = 0  # prefill only: chunked prefill with manifest parts (0: off)
    manifest_part_tokens: int = 0  # prefill only: the least tokens a part carries (0: one per chunk)
    layer_parts: int = 0  # prefill only: the last chunk's state in this many layer parts (0: one part)
    manifest_parts: bool = True  # decode only: accept manifest parts (pipelined transfer)
    # decode only: blocks the prefix cache may keep (0: off; None: the default share of the cache,
    # decided at start-up from the cache's size and the engine: decode_svc/reuse.py reuse_sizes)
    prefix_cache_blocks: int | None = None
    # decode only: state checkpoints kept (0: off; needs the prefix cache; None: sized from its blocks)
    prefix_cache_states: int | None = None
    local_prefill: Literal["fallback", "off"] = "fallback"  # decode only: compute prompts here when no prefill is ready
    local_prefill_below: int = 0  # decode only: prompts of fewer tokens are always computed here
    served_model_names: tuple[str, ...] = ()  # HTTP `model` names; the first is listed. (): --model

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names HTTP requests may give as `model`; the first is the one /v1/models lists."""
        return self.served_model_names or (self.model,)

    @property
    def listen_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


# ----------------------------------------------------------------------------- value parsers


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number 0..65535 (0: pick a free port)")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """`1073741824`, `512MiB`, `8GiB`, `1.5G` (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError("expected a byte count such as 1073741824, 512MiB or 8GiB")
    value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if value < 1:
        raise ValueError("must be at least one byte")
    return value


def host_port(text: str) -> str:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`)."""
    m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d+)", text.strip())
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError("expected HOST:PORT, for example 127.0.0.1:50051")
    return text.strip()


def advertise_address(text: str) -> str:
    """`HOST` or `HOST:PORT` (IPv6 in brackets when a port follows: `[fd00::1]:50051`)."""
    host, port = split_advertised(text)
    if not host or (port is not None and not 0 < port < 65536):
        raise ValueError("expected HOST or HOST:PORT, for example prefill-0.example or 10.0.0.7:50051")
    return text


def split_advertised(text: str) -> tuple[str, int | None]:
    """`HOST[:PORT]` -> (host without brackets, port or None)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, int(port)
    return text, None  # a bare name, IPv4 or IPv6 address


def model_name(text: str) -> str:
    name = text.strip()
    if not name:
        raise ValueError("must not be empty")
    return name


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


def existing_file(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    return path


def engine_id_text(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", text):
        raise ValueError("use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return text


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false (1/0, yes/no, on/off)")


def choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return text

    parse.options = options  # type: ignore[attr-defined]  # read by build_parser for the metavar
    return parse


_METAVARS: dict[Callable[[str], object], str] = {positive_int: "N", positive_float: "SECONDS", port_number: "PORT"}


# ----------------------------------------------------------------------------- flag table


@dataclass(frozen=True)
class Flag:
    name: str  # without the leading dashes
    parse: Callable[[str], object]
    help: str
    default: object = None
    metavar: str | None = None
    roles: tuple[Role, ...] = ("prefill", "decode")
    repeatable: bool = False
    switch: bool = False  # takes no value on the command line (env: true/false)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag(
        "model",
        str,
        "model preset name (see `hybrid-pd models`), path to a Hugging Face config.json, or (--engine hf) a checkpoint directory",
        "tiny-mamba2",
    ),
    Flag("kv-dtype", choice("bf16", "fp16", "fp8", "fp32"), "attention KV cache dtype (default: the model's)"),
    Flag("conv-dtype", choice("bf16", "fp16", "fp8", "fp32"), "conv state dtype (default: the model's)"),
    Flag("ssm-dtype", choice("bf16", "fp16", "fp8", "fp32"), "SSM state dtype (default: the model's)"),
    Flag("tp", positive_int, "tensor-parallel size: ranks in this engine, each with its own NIXL agent and cache", 1),
    Flag("device", choice("cpu", "cuda"), "where cache memory lives: cpu (DRAM) or cuda (rank r on cuda:r)", "cpu"),
    Flag(
        "huge-pages",
        boolean,
        "DRAM caches: ask the kernel for transparent huge pages (2 MiB aligned regions, MADV_HUGEPAGE); a READ "
        "between processes then walks 512x fewer pages (measured 1.5x faster); off: plain 4 KiB pages",
        True,
        metavar="on|off",
    ),
    Flag(
        "engine",
        choice("synthetic", "reference", "hf", "paged"),
        "synthetic: verifiable byte patterns at real-model sizes; reference: the tiny seeded hybrid model; "
        "hf: a Hugging Face checkpoint directory (--model DIR) run by transformers; paged: the checkpoint's "
        "weights run by the project's own math on the paged blocks, decode steps batched and batch-invariant "
        "(nemotron_h, bamba, granitemoehybrid). Default: follows --model (tiny-* presets: reference; a "
        "checkpoint directory: paged where it serves the family, else hf; other presets and config.json "
        "files: synthetic)",
    ),
    Flag(
        "dtype",
        choice("fp32", "bf16", "fp16"),
        "--engine hf or paged: the dtype the model computes in (default: the checkpoint's); the state dtypes follow it",
    ),
    Flag(
        "boundary",
        choice("n-1", "full"),
        "where prefill stops; both services of a pair must use the same. full: prefill computes all N prompt "
        "tokens and samples the first output token, which decode streams before its READ completes "
        "(with --engine hf bit-identical to transformers' generate(); --engine hf or paged only); n-1: prefill "
        "computes N-1, decode the last (vLLM's convention). Default: full for --engine hf and paged, n-1 for the others",
    ),
    Flag(
        "num-blocks",
        positive_int,
        "logical cache blocks per engine (same ids on every rank); excludes --memory-budget. Default, when "
        f"neither is given: enough blocks for {DEFAULT_REQUESTS} requests of {DEFAULT_REQUEST_TOKENS} tokens of "
        f"the model, at most {DEFAULT_MEMORY_FRACTION * 100:.0f}%% of the memory the ranks live in (host MemTotal shared by "
        "the ranks for cpu, each GPU's memory for cuda); the start-up log says what it holds",
    ),
    Flag(
        "memory-budget",
        byte_size,
        "cache bytes per rank, e.g. 8GiB; the block count follows from the page size; excludes --num-blocks. "
        "More than the host (or GPU) has is refused at start",
        metavar="BYTES",
    ),
    Flag(
        "block-size",
        positive_int,
        "logical block size in tokens (default: the smallest the hybrid page layout allows; raised if too small)",
    ),
    Flag(
        "kernel-block-size",
        positive_int,
        "attention kernel block size in tokens; prefill and decode may differ when one divides the other",
        16,
    ),
    Flag("host", str, "address to listen on (0.0.0.0 or :: to accept remote peers)", "127.0.0.1"),
    Flag(
        "port",
        port_number,
        "gRPC port; 0 picks a free one. The bound port is printed on stdout as `LISTENING port=N`",
        metavar="PORT",
    ),
    Flag(
        "engine-id", engine_id_text, "name of this engine; NIXL agents are `<engine-id>-r<rank>` (default: <role>-<host>-<pid>)"
    ),
    Flag(
        "lease-seconds",
        positive_float,
        "prefill: how long a request's blocks stay pinned without news from decode",
        30.0,
        roles=("prefill",),
    ),
    Flag(
        "heartbeat-seconds",
        positive_float,
        "prefill: interval of heartbeats on the Session stream (both directions; decode uses the interval its "
        "prefill peer announces); a peer silent for 1.5 intervals is dropped",
        5.0,
        roles=("prefill",),
    ),
    Flag(
        "read-timeout-seconds",
        positive_float,
        "decode: deadline of one NIXL READ (a frozen prefill leaves a READ in flight forever); "
        "also bounded by the request's deadline and the lease",
        DEFAULT_READ_TIMEOUT_SECONDS,
        roles=("decode",),
    ),
    Flag(
        "max-pinned-requests",
        positive_int,
        "stream credits: prefill grants a decode session at most this many pinned requests (manifests not yet "
        "read); decode asks for this many",
        256,
    ),
    Flag("drain-seconds", positive_float, "on SIGTERM: grace period for in-flight requests before exit", 10.0),
    Flag("metrics-port", port_number, "serve Prometheus metrics over HTTP on this port (default: off)"),
    Flag(
        "http-port",
        port_number,
        "serve the OpenAI-compatible HTTP API (and /health, /metrics, /version) on this port, on the same event "
        "loop as gRPC; 0 picks a free one, printed as `HTTP port=N` before `LISTENING port=N` (default: off)",
        metavar="PORT",
    ),
    Flag(
        "tls-cert",
        existing_file,
        "PEM certificate chain; with --tls-key turns on TLS for the server and its clients",
        metavar="FILE",
    ),
    Flag("tls-key", existing_file, "PEM private key for --tls-cert", metavar="FILE"),
    Flag(
        "tls-ca",
        existing_file,
        "PEM CA bundle this service's clients (decode -> prefill) trust to check the server's certificate "
        "(default: the system roots); a private CA for server-only TLS",
        metavar="FILE",
    ),
    Flag(
        "tls-client-ca",
        existing_file,
        "PEM CA bundle: the server demands client certificates signed by it (mutual TLS); without it the server asks for none",
        metavar="FILE",
    ),
    Flag("loop", choice("uvloop", "asyncio"), "event loop implementation (asyncio is the escape hatch)", "uvloop"),
    Flag("log-level", choice("DEBUG", "INFO", "WARNING", "ERROR"), "log level", "INFO"),
    Flag(
        "log-format",
        choice("text", "json"),
        "text: one readable line per event; json: one JSON object per line with timestamp, level, service, "
        "engine_id and, while serving a request, request_id and peer",
        "text",
    ),
    Flag(
        "manifest-parts",
        boolean,
        "decode: accept a job's state in manifest parts, READing each part while prefill computes the next "
        "(pipelined transfer; prefill sends parts only with --prefill-chunk-tokens); off: always one manifest",
        True,
        metavar="on|off",
        roles=("decode",),
    ),
    Flag(
        "check-state",
        boolean,
        "decode: after every READ compare the received state with what prefill must have written "
        "(every byte for the synthetic engine); a mismatch fails the request with DATA_LOSS",
        False,
        roles=("decode",),
        switch=True,
    ),
    Flag(
        "served-model-name",
        model_name,
        "the model name(s) of the HTTP API, as vLLM's --served-model-name: NAME[,NAME...] (or the flag repeated); "
        "/v1/models lists the first, and a request's `model` may be any of them (another one is a 404 naming "
        "`model`). Default: --model as given",
        repeatable=True,
        metavar="NAME[,NAME...]",
    ),
    Flag(
        "verify-transfer",
        choice("digest", "off"),
        "digest: prefill sends a digest of every rank's FA / conv / SSM state per layer group with the "
        "manifest and decode checks what it READ before its first model step (a mismatch fails the "
        "request with DATA_LOSS); off: no digests (both services should agree)",
        "digest",
    ),
    Flag(
        "prefill",
        host_port,
        "prefill peer HOST:PORT; repeat for several (used round-robin); env takes a comma-separated list. "
        "A DNS name stands for every address it resolves to (a Kubernetes headless Service: one per pod), "
        "re-resolved every --discovery-seconds. Without any, decode serves only the decode leg of a P/D "
        "router (kv_transfer_params name the prefill engine; it is handshaken on first sight)",
        roles=("decode",),
        repeatable=True,
        metavar="HOST:PORT",
    ),
    Flag(
        "reconnect-max-seconds",
        positive_float,
        "decode: a lost or unreachable prefill is retried with exponential backoff (from 0.1 s, full jitter) "
        "up to this many seconds; one that refuses this engine as incompatible (other model or layout) is "
        "retried at this interval and logged at ERROR once per distinct refusal",
        2.0,
        roles=("decode",),
    ),
    Flag(
        "prefill-chunk-tokens",
        non_negative_int,
        "prefill: compute prompts in chunks of N tokens and, for a decode engine that accepts manifest parts, "
        "send the attention blocks each chunk made final while the next chunk computes, so decode READs them "
        "meanwhile (pipelined transfer; the SSM state follows with the last part). 0: off, one manifest after "
        "the whole prompt. The hf engine then prefills in these chunks even for one manifest (bits equal to a colocated run with the same chunks, no longer to one forward); the reference and synthetic "
        "engines write the same bytes in any chunks",
        0,
        roles=("prefill",),
        metavar="N",
    ),
    Flag(
        "manifest-part-tokens",
        non_negative_int,
        "prefill, with --prefill-chunk-tokens: send a manifest part only once at least N more tokens' attention "
        "blocks are final, and always after the chunk before the last (so what moves after the prompt stays one "
        "chunk). Every part costs both sides the same fixed work (a digest call, a message, a READ, a check), so "
        "fewer, larger parts pay it less often where a chunk computes quickly. 0: a part after every chunk that "
        "completes a block",
        0,
        roles=("prefill",),
        metavar="N",
    ),
    Flag(
        "layer-parts",
        non_negative_int,
        "prefill, with --prefill-chunk-tokens: send the last chunk's state in N parts of consecutive model layers, "
        "each as soon as the last chunk computed its layers, so decode READs the first layers' K/V and SSM state "
        "while the later layers still compute (for a decode engine that accepts layer parts; capped at the "
        "model's layer count). The SSM state is final only after the last chunk, so without them it all moves "
        "after the prompt. 0: one last part of every layer",
        0,
        roles=("prefill",),
        metavar="N",
    ),
    Flag(
        "advertise-address",
        advertise_address,
        "prefill: the gRPC address decode engines dial, named in the kv_transfer_params the HTTP prefill leg "
        "answers (remote_host / remote_port); HOST or HOST:PORT (default: --host, or this machine's hostname "
        "when --host is 0.0.0.0 or ::, and the bound gRPC port)",
        roles=("prefill",),
        metavar="HOST[:PORT]",
    ),
    Flag(
        "prefix-cache-blocks",
        non_negative_int,
        "decode: keep up to this many attention blocks of finished prompts and READ only the K/V after a prompt's "
        "cached prefix (engines whose prefix K/V is prompt-independent: the reference engine, the hf engine with "
        "--prefill-chunk-tokens on prefill); evicted least recently used when the cache needs blocks, so they only "
        "hold blocks no request asked for. Default: 25%% of the cache's blocks for an engine whose prefix can be "
        "stable (the reference and hf engines; the synthetic engine keeps nothing); 0: off",
        roles=("decode",),
        metavar="BLOCKS",
    ),
    Flag(
        "prefix-cache-states",
        non_negative_int,
        "decode: keep the conv / SSM state (and the attention blocks the prefix cache does not share) of up to this "
        "many finished requests' computed prompts; a request whose computed prompt is exactly one of them (a retry, "
        "a regenerate, another sample of one prompt) then needs no prefill job and no READ. At the full boundary "
        "(prefill samples the first token) it also needs the same sampling of that token: greedy, or the same "
        "temperature, top_p, top_k and seed, and min_tokens masking the same ids. Needs --prefix-cache-blocks (the "
        "leading attention blocks come from it); the copies live in the cache's own blocks (one request's state each), "
        "taken only from free blocks, and given back least recently used (before the prefix cache's) when a request "
        "needs blocks, never while in use. Default: with the prefix cache on, as many as the prefix cache's share of "
        "blocks holds (a checkpoint takes about one block per KV-cache group); 0: off",
        roles=("decode",),
        metavar="N",
    ),
    Flag(
        "local-prefill",
        choice("fallback", "off"),
        "decode: fallback computes a plain request's prompt on decode's own engine when no prefill engine is "
        "ready (all restarting or unreachable, or none given with --prefill), so losing every prefill engine "
        "slows requests down instead of failing them UNAVAILABLE; readiness waits for a first prefill peer at "
        "start, then stays SERVING. off: such requests fail UNAVAILABLE and readiness follows the prefill peers. Counted in "
        "hybrid_pd_local_prefills_total; a P/D decode leg (kv_transfer_params) never falls back",
        "fallback",
        roles=("decode",),
        metavar="MODE",
    ),
    Flag(
        "local-prefill-below",
        non_negative_int,
        "decode: prompts of fewer than N tokens are always computed on decode's own engine, never sent to a "
        "prefill engine (moving a short prompt's state can cost more than computing it); 0: none",
        0,
        roles=("decode",),
        metavar="N",
    ),
    Flag(
        "discovery-seconds",
        non_negative_float,
        "decode: re-resolve the --prefill DNS names this often; new addresses are handshaken, vanished ones "
        "drained (no new requests, in-flight ones finish) and dropped; 0 resolves once at start",
        5.0,
        roles=("decode",),
        metavar="SECONDS",
    ),
)


def flags_for(role: Role) -> tuple[Flag, ...]:
    return tuple(f for f in FLAGS if role in f.roles)


def build_parser(role: Role) -> argparse.ArgumentParser:
    prog = f"{role}-svc"
    description = {
        "prefill": "The hybrid-pd prefill service: computes a request's KV cache and SSM state into "
        "paged blocks and lets decode engines READ them with NIXL.",
        "decode": "The hybrid-pd decode service: takes Generate requests, gets the prompt's state "
        "from a prefill service with one NIXL READ per (local rank, source rank), and generates tokens.",
    }[role]
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every flag can also be set with an environment variable {ENV_PREFIX}<FLAG> "
        f"(upper case, '-' -> '_'); a flag on the command line wins over the environment.",
    )
    parser.add_argument("--version", action="version", version=f"{prog} {version()}")
    for flag in flags_for(role):
        default = DEFAULT_PORTS[role] if flag.name == "port" else flag.default
        options = getattr(flag.parse, "options", None)
        metavar = flag.metavar or ("{" + ",".join(options) + "}" if options else _METAVARS.get(flag.parse))
        if isinstance(default, bool) and not flag.switch:
            default = "on" if default else "off"
        shown = f"; default {default}" if default is not None else ""
        help_text = f"{flag.help} (env {flag.env}{shown})"
        if flag.switch:
            parser.add_argument(
                f"--{flag.name}", dest=flag.dest, action="store_const", const="true", default=None, help=help_text
            )
            continue
        parser.add_argument(
            f"--{flag.name}",
            dest=flag.dest,
            action="append" if flag.repeatable else "store",
            default=None,
            metavar=metavar,
            help=help_text,
        )
    return parser


def other_service_flag(role: Role, argv: Sequence[str]) -> str | None:
    """The message for the first flag in `argv` that only the other service takes, else None
    (argparse alone would call it "unrecognized", as if it were a typo)."""
    other: Role = "decode" if role == "prefill" else "prefill"
    theirs = {f"--{f.name}" for f in flags_for(other) if role not in f.roles}
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name in theirs:
            return f"{name} is a {other}-svc flag; {role}-svc does not take it"
    return None


# ----------------------------------------------------------------------------- resolution


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
NOT_FLAGS = ("HYBRID_PD_TEST_PAUSE", "HYBRID_PD_TEST_CORRUPT", "HYBRID_PD_SLOW", "HYBRID_PD_CI", "HYBRID_PD_CACHE")


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
    return ServiceSettings(
        role=role,
        model=_req(values, "model", str),
        tp=_req(values, "tp", int),
        device="cuda" if values["device"] == "cuda" else "cpu",
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
        local_prefill="off" if _own(values, "local_prefill", str) == "off" else "fallback",
        local_prefill_below=_own(values, "local_prefill_below", int),
        served_model_names=_served_model_names(values),
        reconnect_max_seconds=_own(values, "reconnect_max_seconds", float),
        advertise_address=_opt(values, "advertise_address", str) if role == "prefill" else None,
        prefill_chunk_tokens=(_opt(values, "prefill_chunk_tokens", int) or 0) if role == "prefill" else 0,
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
