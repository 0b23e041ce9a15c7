"""`hybrid-pd bench control`."""

from __future__ import annotations

import argparse
from typing import Any

from hybridpd_tools.cli.bench_cmd.args import add, common, doc, non_negative, positive, tp_flags
from hybridpd_tools.cli.bench_cmd.running import command_line, finish, guarded, run_async

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


def run(args: argparse.Namespace) -> int:
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
    result = run_async(run_control(cfg, command=command_line("control", args, CONTROL_FLAGS), show_progress=not args.no_progress))
    return finish(args, result, format_control(result), None)


def add_parser(sub: Any) -> None:
    """`hybrid-pd bench control`."""
    c = sub.add_parser(
        "control",
        help="control-plane cost of one request with a tiny state",
        description=doc("hybridpd_tools.bench.control"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add(c, "model", "tiny-mamba2", "model preset (a tiny one keeps the state tiny)", metavar="PRESET")
    tp_flags(c)
    add(c, "prompt-tokens", 8, "prompt length", type=positive, metavar="N")
    add(c, "requests", 200, "measured requests", type=positive, metavar="K")
    add(c, "warmup", 20, "unmeasured requests first", type=non_negative, metavar="N")
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
    common(c, plot=False)
    c.set_defaults(func=guarded(run))
