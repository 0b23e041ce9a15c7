"""`hybrid-pd bench`: measurements, each against a baseline measured in the same run.

  transfer   our READ path (real services, synthetic engine at real-model sizes) against a raw
             NIXL READ of the identical descriptors, a raw NIXL READ of the same bytes with one
             descriptor per region, and a single-threaded memcpy of the same bytes
  control    control-plane cost of one request with a tiny state (median and p99)
  e2e        TTFT, inter-token latency and tokens/s, disaggregated vs colocated, per concurrency
             (--workload long-prompt: per prompt length; --workload multi-turn: per conversation turn)
  descids    micro-benchmark of per-request descriptor ids (read_indices) for 100k blocks

Tables go to stdout, progress to stderr; --json prints one JSON object instead (a `schema` key
names its shape). Every flag can also come from the environment: HYBRID_PD_<FLAG>. Exit code 0
when the benchmark ran (targets met or not: they are reported, not enforced), 1 when it could
not run, 2 for invalid arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from shared.config import ENV_PREFIX, boolean

if TYPE_CHECKING:
    from hybridpd_tools.bench.setups import SetupConfig

DESCRIPTION = __doc__


def _env(flag: str, default: Any) -> Any:
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def _on_off(text: str) -> str:
    """The services' --huge-pages values (on/off, true/false, 1/0, yes/no), spelled on|off."""
    try:
        return "on" if boolean(text) else "off"
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}, got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _levels(text: str) -> tuple[int, ...]:
    from hybridpd_tools.bench.e2e import parse_levels

    try:
        return parse_levels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lengths(text: str) -> tuple[int, ...]:
    from hybridpd_tools.bench.e2e import parse_levels

    try:
        return parse_levels(text, "prompt length")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add(p: argparse.ArgumentParser, flag: str, default: Any, help: str, **kw: Any) -> None:
    """A flag whose default can come from HYBRID_PD_<FLAG> (parsed by `type` like a typed value)."""
    env = ENV_PREFIX + flag.upper().replace("-", "_")
    shown = "" if default is None else f"; default {default}"
    p.add_argument(f"--{flag}", default=_env(flag, default), help=f"{help} (env {env}{shown})", **kw)


def _common(p: argparse.ArgumentParser, plot: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    if plot:
        _add(p, "plot", None, "write a chart here, PNG or SVG by the suffix (needs matplotlib: the plot extra)", metavar="FILE")


def _command(name: str, args: argparse.Namespace, flags: Sequence[str]) -> str:
    """The command line reproducing this run, every value spelled out."""
    parts = ["hybrid-pd", "bench", name]
    for flag in flags:
        value = getattr(args, flag.replace("-", "_"))
        if isinstance(value, bool):
            if value:
                parts.append(f"--{flag}")
        elif isinstance(value, (tuple, list)):
            parts += [f"--{flag}", ",".join(str(v) for v in value)]
        elif value is not None:
            parts += [f"--{flag}", str(value)]
    return " ".join(parts)


def _run_async(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _finish(
    args: argparse.Namespace, result: dict[str, Any], table: str, chart: Callable[[], list[tuple[str, Any]]] | None
) -> int:
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table)
    if chart is not None and getattr(args, "plot", None):
        from hybridpd_tools.bench.plotting import save

        for path, figure in chart():
            written, note = save(figure, path)
            print(note or f"wrote {written}", file=sys.stderr)
    return 0


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "plot", None):
            from hybridpd_tools.bench.plotting import MISSING_MATPLOTLIB, available

            if not available():  # refused before the run, not after it
                print(f"hybrid-pd bench {args.bench_command}: --plot {args.plot} {MISSING_MATPLOTLIB}", file=sys.stderr)
                return 2
        try:
            return fn(args)
        except Exception as e:  # one line saying why; Ctrl-C is no Exception: main() ends it (130)
            print(f"hybrid-pd bench {args.bench_command}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1

    return run


# ---- transfer ----

TRANSFER_FLAGS = (
    "model", "prefill-tp", "decode-tp", "prompt-tokens", "requests", "warmup", "kernel-block-size", "check-state", "huge-pages",
    "device",
)  # fmt: skip


def _transfer(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.plotting import Chart, Series
    from hybridpd_tools.bench.transfer import TransferConfig, run_transfer
    from hybridpd_tools.bench.transfer_report import chart_rows, format_table

    if args.hosts and args.inside_hosts is None:
        from hybridpd_tools.bench.hosts import run_on_hosts

        inner = _command("transfer", args, TRANSFER_FLAGS).split()[3:]
        inner += [flag for flag, on in (("--json", args.json), ("--no-progress", args.no_progress)) if on]
        inner += ["--plot", args.plot] if args.plot else []
        return run_on_hosts(inner, args.link_rate, args.link_delay)
    if args.device == "cuda":
        from hybridpd_tools.bench.raw_memory import cuda_ready

        why = cuda_ready(max(args.prefill_tp, args.decode_tp))
        if why is not None:
            print(f"hybrid-pd bench transfer: --device cuda: {why}", file=sys.stderr)
            return 2
        if args.hosts:
            print(
                "hybrid-pd bench transfer: --device cuda and --hosts do not go together (the namespace hosts share no GPU)",
                file=sys.stderr,
            )
            return 2
    launch: list[str] = []
    prefill_host = "127.0.0.1"
    link = None
    if args.inside_hosts is not None:
        from hybridpd_tools.bench.hosts import inside_launch

        launch, prefill_host = inside_launch(args.inside_hosts)
        link = json.loads(args.link_note or "{}")
    cfg = TransferConfig(
        model=args.model,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prompt_tokens=args.prompt_tokens,
        requests=args.requests,
        warmup=args.warmup,
        kernel_block_size=args.kernel_block_size,
        check_state=args.check_state,
        huge_pages=args.huge_pages == "on",
        device=args.device,
    )
    command = _command("transfer", args, TRANSFER_FLAGS)
    if link is not None:
        command += " --hosts" + "".join(f" --link-{k} {link[k]}" for k in ("rate", "delay") if link.get(k))
    result = _run_async(
        run_transfer(
            cfg, command=command, show_progress=not args.no_progress, prefill_launch=launch, prefill_host=prefill_host, link=link
        )
    )

    def chart() -> list[tuple[str, Any]]:
        labels, values = chart_rows(result)
        title = f"READ throughput, {cfg.model} TP {cfg.prefill_tp}->{cfg.decode_tp}, {cfg.prompt_tokens}-token prompt"
        return [
            (
                args.plot,
                Chart(title, "", "GB/s", [Series("GB/s", list(range(len(values))), values)], kind="bar", categories=labels),
            )
        ]

    return _finish(args, result, format_table(result), chart)


# ---- control ----

CONTROL_FLAGS = (
    "model",
    "prefill-tp",
    "decode-tp",
    "prompt-tokens",
    "requests",
    "warmup",
    "breakdown",
    "separate-processes",
    "calls",
)


def _control(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.control import ControlConfig, format_control, run_control

    cfg = ControlConfig(
        model=args.model,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prompt_tokens=args.prompt_tokens,
        requests=args.requests,
        warmup=args.warmup,
        breakdown=args.breakdown,
        separate_processes=args.separate_processes,
        calls=args.calls,
    )
    result = _run_async(run_control(cfg, command=_command("control", args, CONTROL_FLAGS), show_progress=not args.no_progress))
    return _finish(args, result, format_control(result), None)


# ---- e2e ----

E2E_FLAGS = (
    "workload", "model", "engine", "concurrency", "prompt-tokens", "max-tokens", "requests-per-level", "warmup",
    "interleave", "prefill-tp", "decode-tp", "boundary", "crossover-model",
)  # fmt: skip
LONG_PROMPT_FLAGS = (
    "workload", "model", "engine", "prompt-lengths", "requests-per-length", "max-tokens", "warmup", "prefill-tp", "decode-tp",
    "prefill-chunk-tokens", "manifest-part-tokens", "layer-parts", "boundary",
)  # fmt: skip
MULTI_TURN_FLAGS = (
    "workload", "model", "engine", "turns", "conversations", "first-turn-tokens", "turn-tokens", "max-tokens", "warmup",
    "prefill-tp", "decode-tp", "prefix-cache-blocks", "prefill-chunk-tokens", "manifest-part-tokens",
)  # fmt: skip
REPEAT_FLAGS = (
    "workload", "model", "engine", "prompts", "repeats", "prompt-tokens", "max-tokens", "warmup", "prefill-tp", "decode-tp",
    "prefill-chunk-tokens", "manifest-part-tokens", "boundary",
)  # fmt: skip
WORKLOADS = ("concurrency", "long-prompt", "multi-turn", "repeat")


def _engine_and_model(args: argparse.Namespace) -> None:
    """Fill in the workload's engine (concurrency: reference; the long ones: hf, whose prefill of
    a 32k prompt takes seconds, not minutes) and model (reference: tiny-mamba2; hf: the tiny
    checkpoint of --hf-family and --hf-size, made on first use)."""
    if args.engine is None:
        args.engine = "reference" if args.workload in ("concurrency", "repeat") else "hf"
    if args.model is None:
        if args.engine in ("hf", "paged"):
            from shared.engine.hf.tiny_checkpoints import cached_checkpoint

            args.model = cached_checkpoint(args.hf_family, size=args.hf_size)
        else:
            args.model = "tiny-mamba2"


def _setup_config(args: argparse.Namespace, flags: Sequence[str]) -> SetupConfig:
    """What the workload's setups share, from the flags it takes (`flags`): a flag the workload
    does not take keeps the default."""
    from hybridpd_tools.bench.setups import SetupConfig

    return SetupConfig(
        model=args.model,
        engine=args.engine,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_chunk_tokens=args.prefill_chunk_tokens if "prefill-chunk-tokens" in flags else 0,
        manifest_part_tokens=args.manifest_part_tokens if "manifest-part-tokens" in flags else 0,
        layer_parts=args.layer_parts if "layer-parts" in flags else 0,
        boundary=(args.boundary or "") if "boundary" in flags else "",
    )


def _e2e(args: argparse.Namespace) -> int:
    _engine_and_model(args)
    if args.workload == "long-prompt":
        return _long_prompt(args)
    if args.workload == "multi-turn":
        return _multi_turn(args)
    if args.workload == "repeat":
        return _repeat(args)
    from hybridpd_tools.bench.e2e import E2EConfig, e2e_charts, format_e2e, run_e2e
    from hybridpd_tools.bench.plotting import sibling

    cfg = E2EConfig(
        setup=_setup_config(args, E2E_FLAGS),
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        requests_per_level=args.requests_per_level,
        warmup=args.warmup,
        interleave=args.interleave,
        crossover_model=args.crossover_model or "",
    )
    result = _run_async(run_e2e(cfg, command=_command("e2e", args, E2E_FLAGS), show_progress=not args.no_progress))

    def chart() -> list[tuple[str, Any]]:
        return [(str(sibling(args.plot, tag)), figure) for tag, figure in e2e_charts(result)]

    return _finish(args, result, format_e2e(result), chart)


def _no_chart(args: argparse.Namespace) -> None:
    if args.plot:
        print(f"--plot: the {args.workload} workload has no chart (its figures are in the table and --json)", file=sys.stderr)


def _long_prompt(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.long_prompt import LongPromptConfig, format_long_prompt, run_long_prompt

    cfg = LongPromptConfig(
        setup=_setup_config(args, LONG_PROMPT_FLAGS),
        prompt_lengths=args.prompt_lengths,
        requests_per_length=args.requests_per_length,
        max_tokens=args.max_tokens,
        warmup=args.warmup,
    )
    command = _command("e2e", args, LONG_PROMPT_FLAGS)
    result = _run_async(run_long_prompt(cfg, command=command, show_progress=not args.no_progress))
    _no_chart(args)
    return _finish(args, result, format_long_prompt(result), None)


def _multi_turn(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.multi_turn import MultiTurnConfig, format_multi_turn, run_multi_turn

    cfg = MultiTurnConfig(
        setup=_setup_config(args, MULTI_TURN_FLAGS),
        turns=args.turns,
        conversations=args.conversations,
        first_turn_tokens=args.first_turn_tokens,
        turn_tokens=args.turn_tokens,
        max_tokens=args.max_tokens,
        warmup=args.warmup,
        prefix_cache_blocks=args.prefix_cache_blocks,
    )
    command = _command("e2e", args, MULTI_TURN_FLAGS)
    result = _run_async(run_multi_turn(cfg, command=command, show_progress=not args.no_progress))
    _no_chart(args)
    return _finish(args, result, format_multi_turn(result), None)


def _repeat(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.repeat import RepeatConfig, format_repeat, run_repeat

    cfg = RepeatConfig(
        setup=_setup_config(args, REPEAT_FLAGS),
        prompts=args.prompts,
        repeats=args.repeats,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        warmup=args.warmup,
    )
    command = _command("e2e", args, REPEAT_FLAGS)
    result = _run_async(run_repeat(cfg, command=command, show_progress=not args.no_progress))
    _no_chart(args)
    return _finish(args, result, format_repeat(result), None)


# ---- descids ----

DESCIDS_FLAGS = ("model", "blocks", "prefill-tp", "decode-tp", "kernel-block-size", "repeat")


def _descids(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.descids import DescIdsConfig, format_descids, run_descids

    cfg = DescIdsConfig(
        model=args.model,
        blocks=args.blocks,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        kernel_block_size=args.kernel_block_size,
        repeat=args.repeat,
    )
    result = run_descids(cfg, command=_command("descids", args, DESCIDS_FLAGS), show_progress=not args.no_progress)
    return _finish(args, result, format_descids(result), None)


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: transfer, control, e2e, descids", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    _add_transfer(sub)
    _add_control(sub)
    _add_e2e(sub)
    _add_descids(sub)


def _tp_flags(p: argparse.ArgumentParser) -> None:
    _add(p, "prefill-tp", 1, "prefill TP size", type=_positive, metavar="P")
    _add(p, "decode-tp", 1, "decode TP size", type=_positive, metavar="D")


def _add_transfer(sub: Any) -> None:
    """`hybrid-pd bench transfer`."""
    t = sub.add_parser(
        "transfer",
        help="our READ path vs raw NIXL and memcpy (real services, real-model sizes)",
        description=_doc("hybridpd_tools.bench.transfer"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add(t, "model", "nemotron-3-nano-30b-a3b", "model preset or config.json path", metavar="PRESET")
    _tp_flags(t)
    _add(t, "prompt-tokens", 2048, "prompt length N (N - 1 tokens are transferred for SSM models)", type=_positive, metavar="N")
    _add(t, "requests", 10, "measured requests (each interleaved with one round of every baseline)", type=_positive, metavar="K")
    _add(t, "warmup", 1, "unmeasured rounds first (connection wire-up, first-touch)", type=_non_negative, metavar="N")
    _add(t, "kernel-block-size", 16, "attention kernel block size, both sides", type=_positive, metavar="TOKENS")
    t.add_argument(
        "--check-state", action="store_true", help="decode verifies every transferred byte (slower requests; READ time unchanged)"
    )
    _add(
        t,
        "huge-pages",
        "on",
        "services' caches and every baseline's buffers on transparent huge pages, or all on 4 KiB pages",
        type=_on_off,
        metavar="on|off",
    )
    _add(
        t,
        "device",
        "cpu",
        "where the services' caches and the baselines' buffers live: cpu, or cuda (rank r on cuda:r; READs VRAM to "
        "VRAM, (c) a device copy)",
        choices=("cpu", "cuda"),
    )
    t.add_argument(
        "--hosts",
        action="store_true",
        help="prefill on a second host: two Linux namespace hosts on a private bridge, UCX over TCP "
        "(needs root; hybridpd_tools/bench/hosts.py)",
    )
    t.add_argument("--link-rate", metavar="RATE", help="with --hosts: shape the link to RATE (tc syntax, e.g. 10gbit)")
    t.add_argument("--link-delay", metavar="DELAY", help="with --hosts and --link-rate: one-way delay (e.g. 100us)")
    t.add_argument("--inside-hosts", help=argparse.SUPPRESS)  # set by --hosts for the run on the decode host
    t.add_argument("--link-note", help=argparse.SUPPRESS)
    _common(t)
    t.set_defaults(func=_guarded(_transfer))


def _add_control(sub: Any) -> None:
    """`hybrid-pd bench control`."""
    c = sub.add_parser(
        "control",
        help="control-plane cost of one request with a tiny state",
        description=_doc("hybridpd_tools.bench.control"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add(c, "model", "tiny-mamba2", "model preset (a tiny one keeps the state tiny)", metavar="PRESET")
    _tp_flags(c)
    _add(c, "prompt-tokens", 8, "prompt length", type=_positive, metavar="N")
    _add(c, "requests", 200, "measured requests", type=_positive, metavar="K")
    _add(c, "warmup", 20, "unmeasured requests first", type=_non_negative, metavar="N")
    where = c.add_mutually_exclusive_group()
    where.add_argument(
        "--breakdown",
        action="store_true",
        help="also time a separate pass step by step (stream, allocation, thread hops, post, notification) "
        "and print the floor of the design measured in the same run",
    )
    where.add_argument(
        "--separate-processes",
        action="store_true",
        help="run the prefill service in a process of its own, as deployed (default: both in this "
        "process, which lets --breakdown time them step by step)",
    )
    c.add_argument(
        "--calls",
        action="store_true",
        help="also count the event loop's Python and C calls per step, per request and per Generate RPC "
        "(two more passes under sys.setprofile; both services in this process)",
    )
    _common(c, plot=False)
    c.set_defaults(func=_guarded(_control))


def _add_e2e(sub: Any) -> None:
    """`hybrid-pd bench e2e`."""
    e = sub.add_parser(
        "e2e",
        help="TTFT, inter-token latency, tokens/s: disaggregated vs colocated",
        description="\n\n".join(
            _doc(m)
            for m in (
                "hybridpd_tools.bench.e2e",
                "hybridpd_tools.bench.long_prompt",
                "hybridpd_tools.bench.multi_turn",
                "hybridpd_tools.bench.repeat",
            )
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add(
        e,
        "workload",
        "concurrency",
        "concurrency (levels of concurrent requests), long-prompt (TTFT and bytes per prompt length), "
        "multi-turn (conversations, each turn extending the previous one) or repeat (the same prompts again, with and "
        "without decode's state checkpoints)",
        choices=WORKLOADS,
    )
    _add(
        e,
        "model",
        None,
        "model preset, or with --engine hf a checkpoint directory (default: tiny-mamba2; with --engine hf the "
        "tiny --hf-family checkpoint, made on first use)",
        metavar="PRESET|DIR",
    )
    _add(
        e,
        "engine",
        None,
        "reference (tiny models, real math), synthetic (real-model sizes, no math), paged (a Hugging Face "
        "checkpoint on the batched engine) or hf (a checkpoint run by transformers); default reference for the "
        "concurrency workload, hf for long-prompt and multi-turn",
        choices=("reference", "synthetic", "paged", "hf"),
    )
    _add(e, "hf-family", "nemotron_h", "with --engine hf and no --model: the family of the tiny checkpoint", metavar="FAMILY")
    _add(
        e,
        "hf-size",
        "tiny",
        "with --engine hf and no --model: tiny (the tests' checkpoint) or small (nemotron_h only, about 60x the "
        "compute per token: a 2k-token prefill then costs what a real one does relative to the network hops)",
        choices=("tiny", "small"),
    )
    _add(e, "concurrency", "1,2,4,8", "concurrency levels, e.g. 1,2,4,8,16,32,64", type=_levels, metavar="LIST")
    _add(
        e,
        "prompt-tokens",
        128,
        "prompt length (2048 for the TTFT target; the reference engine takes seconds per prompt)",
        type=_positive,
        metavar="N",
    )
    _add(e, "max-tokens", 32, "tokens generated per request", type=_positive, metavar="N")
    _add(e, "requests-per-level", 0, "requests per level and setup (0: max(4, 2 x concurrency))", type=_non_negative, metavar="K")
    _add(e, "warmup", 2, "unmeasured requests per setup before the first level", type=_non_negative, metavar="N")
    _add(
        e,
        "interleave",
        2,
        "parts per level, run alternately on the two setups (= requests: one by one)",
        type=_positive,
        metavar="N",
    )
    _tp_flags(e)
    _add(
        e,
        "boundary",
        None,
        "concurrency: where prefill stops, as the services' --boundary: full (prefill samples the first token; "
        "hf only) or n-1; default the engine's (full for hf). Sets the TTFT target: 1.02 at full, 1.10 at n-1. "
        "long-prompt too: at full the first token leaves before the READ, so TTFT holds no transfer; n-1 puts it back. "
        "repeat too: at full a state checkpoint also keeps the first token prefill drew",
        choices=("full", "n-1"),
    )
    _add_long_prompt_flags(e)
    _add_multi_turn_and_repeat_flags(e)
    _common(e)
    e.set_defaults(func=_guarded(_e2e))


def _add_long_prompt_flags(e: argparse.ArgumentParser) -> None:
    """bench e2e: the long-prompt workload's flags (and the transfer modes multi-turn shares)."""
    _add(e, "crossover-model", None, "model of the bytes-vs-prompt-length crossover (default: --model)", metavar="PRESET")
    _add(
        e,
        "prompt-lengths",
        "8192,16384,32768",
        "long-prompt: prompt lengths (the tiny hf checkpoint prefills 32k tokens in ~15 s on two cores)",
        type=_lengths,
        metavar="LIST",
    )
    _add(e, "requests-per-length", 2, "long-prompt: prompts per length, each on both setups", type=_positive, metavar="K")
    _add(
        e,
        "prefill-chunk-tokens",
        0,
        "long-prompt: pipelined transfer (prefill and colocated compute in chunks of N; the decode service READs "
        "manifest parts meanwhile) measured against an unpipelined decode service on the same prefill, in the same "
        "run; multi-turn: the pair transfers in manifest parts (after the cached prefix with --prefix-cache-blocks); "
        "0: off",
        type=_non_negative,
        metavar="N",
    )
    _add(
        e,
        "manifest-part-tokens",
        0,
        "with --prefill-chunk-tokens: prefill sends a manifest part only once M more tokens are final, and after the "
        "chunk before the last (fewer parts, each paying the per-part costs once); 0: a part after every chunk",
        type=_non_negative,
        metavar="M",
    )
    _add(
        e,
        "layer-parts",
        0,
        "long-prompt, with --prefill-chunk-tokens: prefill sends the last chunk's state in L parts of consecutive "
        "model layers, each as soon as its layers are computed (the SSM state is final only in the last chunk); "
        "0: one last part",
        type=_non_negative,
        metavar="L",
    )


def _add_multi_turn_and_repeat_flags(e: argparse.ArgumentParser) -> None:
    """bench e2e: the multi-turn and repeat workloads' flags."""
    _add(e, "turns", 4, "multi-turn: turns per conversation", type=_positive, metavar="K")
    _add(e, "prompts", 3, "repeat: distinct prompts, each sent --repeats times", type=_positive, metavar="N")
    _add(e, "repeats", 3, "repeat: times each prompt is sent, in a row", type=_positive, metavar="K")
    _add(e, "conversations", 2, "multi-turn: conversations, each on both setups", type=_positive, metavar="N")
    _add(e, "first-turn-tokens", 2048, "multi-turn: the first turn's prompt length", type=_positive, metavar="N")
    _add(
        e,
        "turn-tokens",
        256,
        "multi-turn: each later turn's new user message, after the previous answer",
        type=_positive,
        metavar="N",
    )
    _add(
        e,
        "prefix-cache-blocks",
        0,
        "multi-turn: --prefix-cache-blocks on the decode service and on prefill (its boundary cache, with "
        "--prefill-chunk-tokens on the paged engine), each with that many blocks more (0: no prefix reuse, the baseline)",
        type=_non_negative,
        metavar="N",
    )


def _add_descids(sub: Any) -> None:
    """`hybrid-pd bench descids`."""
    d = sub.add_parser(
        "descids",
        help="micro-benchmark of per-request descriptor ids (read_indices)",
        description=_doc("hybridpd_tools.bench.descids"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add(d, "model", "nemotron-3-nano-30b-a3b", "model preset", metavar="PRESET")
    _add(d, "blocks", 100_000, "kernel blocks of the request, in every attention group", type=_positive, metavar="B")
    _tp_flags(d)
    _add(d, "kernel-block-size", 16, "attention kernel block size, both sides", type=_positive, metavar="TOKENS")
    _add(d, "repeat", 30, "timed calls", type=_positive, metavar="N")
    _common(d, plot=False)
    d.set_defaults(func=_guarded(_descids))


def _doc(module: str) -> str:
    """A module's docstring as a subcommand's description, without importing torch or NIXL for --help."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    import ast

    with open(spec.origin) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""
