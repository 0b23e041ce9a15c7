"""The services' flag table: every flag of prefill-svc and decode-svc, its value type, help and
default, and which service takes it. Each flag can also come from the environment as
`HYBRID_PD_<FLAG>`. The table's order is the order of `--help`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from shared.cache.cache_size import DEFAULT_MEMORY_FRACTION, DEFAULT_REQUEST_TOKENS, DEFAULT_REQUESTS
from shared.config.values import (
    advertise_address,
    boolean,
    byte_size,
    choice,
    engine_id_text,
    existing_file,
    host_port,
    model_name,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)

ENV_PREFIX = "HYBRID_PD_"
Role = Literal["prefill", "decode"]
DEFAULT_PORTS: dict[str, int] = {"prefill": 50051, "decode": 50052}
DEFAULT_READ_TIMEOUT_SECONDS = 10.0
# Threads a paged decode step's tiles run on (see the flag's help for the choice).
DEFAULT_DECODE_THREADS = 1
# Threads a paged batched prefill step's chunks run on (see the flag's help for the choice).
DEFAULT_PREFILL_THREADS = 1
# Batched prefill's token budget per step (the part vLLM's max_num_batched_tokens plays), by the
# device the engine computes on. An accelerator computes a step of many chunks in little more
# time than one, so a large budget serves a burst of prompts in few steps. A CPU core computes
# a step's tokens one after another (a step of 8 prompts takes 8 prompts' time), so there a
# large budget only makes a burst's first prompts wait for its last; two 128-token prompts a
# step keep what batching saves on a CPU and answer each prompt about as soon as it is computed.
# The services resolve it from --device (`default_max_batched_tokens`); the step loops' own
# default, where a caller passes no budget (tests, library use), is the accelerator's.
DEFAULT_MAX_BATCHED_TOKENS = 2048
CPU_MAX_BATCHED_TOKENS = 256
# --local-prefill share: the prompt tokens queued on the least loaded prefill engine before
# decode computes a prompt itself (decode_svc/local_prefill.py `shares_load`): four 2k prompts, or
# 64 of 128 tokens. Work, not jobs: a queue of short prompts clears in a few prefill steps, and
# taking them would only slow the steps of the requests decode runs.
DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS = 8192


def default_max_batched_tokens(device: str) -> int:
    """--max-batched-tokens when none is given, for an engine on `device` (cpu or cuda)."""
    return CPU_MAX_BATCHED_TOKENS if device == "cpu" else DEFAULT_MAX_BATCHED_TOKENS


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
        "batch-invariant",
        boolean,
        "--engine paged: on computes a step's requests (decode) or chunks (prefill) in tiles of a fixed row count, "
        "so a request's bits are the same whatever shares its step (and disaggregated equals colocated bit for "
        "bit); off runs one GEMM over the whole batch: faster, but a request's bits depend on the batch it ran "
        "in. Engines that do not batch (reference, synthetic, hf) ignore it",
        True,
        metavar="on|off",
    ),
    Flag(
        "native-kernels",
        boolean,
        "--engine paged, fp32 models on a CPU: on runs parts of a decode step as C kernels, built once per "
        "machine with the system's C compiler: the Mamba2 conv and state updates in place in the state pages, and "
        "attention reading K/V where they lie in the blocks (one rank holding every head); off (or no compiler) "
        "runs the torch path, which gathers states and K/V out of the pages first. Both are batch-invariant; "
        "their outputs differ in the last bits (orders of sums), so compare runs made with the same setting",
        True,
        metavar="on|off",
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
        "decode-threads",
        positive_int,
        "decode, --engine paged: threads that compute a decode step at once, each one forward over a share of "
        "whole tiles of 16 requests (with one intra-op thread; the tokens are the same bits with any count). More "
        "than 1 helps only with more than 16 running requests and idle cores: on a host whose cores prefill and "
        "clients share, keep 1",
        DEFAULT_DECODE_THREADS,
        roles=("decode",),
        metavar="N",
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
        "stream-interval",
        positive_int,
        "decode: tokens a stream coalesces before it sends them (vLLM's --stream-interval). 1: one gRPC "
        "TokenChunk and one SSE event per token, the moment its step ends; N > 1: a sequence's first token "
        "alone, then its tokens in groups of N (fewer messages per token), and whatever is left the moment "
        "the sequence ends or fails",
        1,
        roles=("decode",),
        metavar="N",
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
        "max-batched-tokens",
        positive_int,
        "the most prompt tokens one prefill step computes (batched prefill, on an engine that batches: "
        "paged). Jobs' next chunks share a step oldest first; the oldest always runs, even alone over the budget, "
        "and with --prefill-chunk-tokens a long prompt takes one chunk a step, so short prompts arriving "
        "meanwhile share its steps. Jobs sent in manifest parts share steps too, but with --layer-parts their "
        "last chunk computes alone. On decode: the prompts it computes itself (--local-prefill) share steps "
        "the same way, taking turns with decode steps on the compute thread. A prompt's bits do not depend on "
        f"what shares its steps. Default: {CPU_MAX_BATCHED_TOKENS} with --device cpu, where a step's prompts compute "
        f"one after another and a larger budget only delays a burst's first tokens; {DEFAULT_MAX_BATCHED_TOKENS} "
        "with --device cuda",
        None,
        roles=("prefill", "decode"),
        metavar="N",
    ),
    Flag(
        "prefill-threads",
        positive_int,
        "prefill, --engine paged: threads that compute a batched prefill step at once: the step's chunks are "
        "split into up to N groups of about equal tokens, each group one forward on its own thread with one "
        "intra-op thread. A prompt's state and first token are the same bits with any count. More than 1 helps "
        "only when steps hold several chunks (bursts of arrivals) and N cores are idle: on a host whose cores "
        "decode and clients share, keep 1. decode-svc computes its local prefills on its one compute thread and "
        "does not take it",
        DEFAULT_PREFILL_THREADS,
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
        "after the prompt. On an engine that batches prefill (paged) that last chunk computes alone, outside the "
        "batched steps. 0: one last part of every layer",
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
        "stable (the reference and hf engines; the synthetic engine keeps nothing); 0: off. prefill: keep the "
        "conv / SSM state at chunk boundaries (with --prefill-chunk-tokens, on an engine that resumes a chunked "
        "prefill exactly: the paged engine) in up to this many blocks, so a prompt sharing a kept boundary's tokens "
        "(a conversation's next turn) computes only the chunks after its longest one; the boundaries share their "
        "attention blocks, take their copies only from free blocks and are evicted least recently used when a job "
        "needs blocks. Default: 25%% of the cache's blocks when prefill runs chunked on such an engine; 0: off",
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
        choice("fallback", "share", "off"),
        "decode: fallback computes a plain request's prompt on decode's own engine when no prefill engine is "
        "ready (all restarting or unreachable, or none given with --prefill), so losing every prefill engine "
        "slows requests down instead of failing them UNAVAILABLE; readiness waits for a first prefill peer at "
        "start, then stays SERVING. share: as fallback, and decode also computes a prompt itself while the least "
        "loaded prefill engine has --local-prefill-queue-tokens prompt tokens or more queued and more than decode is "
        "computing itself (a burst of long prompts splits between the two instead of queueing on prefill); only prompts that "
        "prefill engine would compute with the same bits (same TP size and --prefill-chunk-tokens) and that hit "
        "neither of decode's caches. off: such requests fail UNAVAILABLE and readiness follows the prefill peers. "
        "Counted in hybrid_pd_local_prefills_total by reason; a P/D decode leg (kv_transfer_params) never falls back",
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
        "local-prefill-queue-tokens",
        positive_int,
        "decode, with --local-prefill share: the prompt tokens the least loaded prefill engine must have queued "
        "(its jobs not computed yet: this decode engine's, and the others' as it reports them) before decode "
        "computes a prompt itself; a lower value takes prompts from prefill sooner, at the cost of steps of the "
        "requests decode is running",
        DEFAULT_LOCAL_PREFILL_QUEUE_TOKENS,
        roles=("decode",),
        metavar="TOKENS",
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
