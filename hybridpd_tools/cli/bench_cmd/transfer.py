"""`hybrid-pd bench transfer`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybridpd_tools.cli.bench_cmd.args import add, common, doc, non_negative, on_off, positive, tp_flags
from hybridpd_tools.cli.bench_cmd.running import command_line, finish, guarded, run_async

TRANSFER_FLAGS = (
    "model", "prefill-tp", "decode-tp", "prompt-tokens", "requests", "warmup", "kernel-block-size", "check-state", "huge-pages",
    "device",
)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.plotting import Chart, Series
    from hybridpd_tools.bench.transfer import TransferConfig, run_transfer
    from hybridpd_tools.bench.transfer_report import chart_rows, format_table

    if args.hosts and args.inside_hosts is None:
        from hybridpd_tools.bench.hosts import run_on_hosts

        inner = command_line("transfer", args, TRANSFER_FLAGS).split()[3:]
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
    command = command_line("transfer", args, TRANSFER_FLAGS)
    if link is not None:
        command += " --hosts" + "".join(f" --link-{k} {link[k]}" for k in ("rate", "delay") if link.get(k))
    result = run_async(
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

    return finish(args, result, format_table(result), chart)


def add_parser(sub: Any) -> None:
    """`hybrid-pd bench transfer`."""
    t = sub.add_parser(
        "transfer",
        help="our READ path vs raw NIXL and memcpy (real services, real-model sizes)",
        description=doc("hybridpd_tools.bench.transfer"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add(t, "model", "nemotron-3-nano-30b-a3b", "model preset or config.json path", metavar="PRESET")
    tp_flags(t)
    add(t, "prompt-tokens", 2048, "prompt length N (N - 1 tokens are transferred for SSM models)", type=positive, metavar="N")
    add(t, "requests", 10, "measured requests (each interleaved with one round of every baseline)", type=positive, metavar="K")
    add(t, "warmup", 1, "unmeasured rounds first (connection wire-up, first-touch)", type=non_negative, metavar="N")
    add(t, "kernel-block-size", 16, "attention kernel block size, both sides", type=positive, metavar="TOKENS")
    t.add_argument(
        "--check-state", action="store_true", help="decode verifies every transferred byte (slower requests; READ time unchanged)"
    )
    add(
        t,
        "huge-pages",
        "on",
        "services' caches and every baseline's buffers on transparent huge pages, or all on 4 KiB pages",
        type=on_off,
        metavar="on|off",
    )
    add(
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
    common(t)
    t.set_defaults(func=guarded(run))
