"""`hybrid-pd bench descids`."""

from __future__ import annotations

import argparse
from typing import Any

from hybridpd_tools.cli.bench_cmd.args import add, common, doc, positive, tp_flags
from hybridpd_tools.cli.bench_cmd.running import command_line, finish, guarded

DESCIDS_FLAGS = ("model", "blocks", "prefill-tp", "decode-tp", "kernel-block-size", "repeat")


def run(args: argparse.Namespace) -> int:
    from hybridpd_tools.bench.descids import DescIdsConfig, format_descids, run_descids

    cfg = DescIdsConfig(
        model=args.model,
        blocks=args.blocks,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        kernel_block_size=args.kernel_block_size,
        repeat=args.repeat,
    )
    result = run_descids(cfg, command=command_line("descids", args, DESCIDS_FLAGS), show_progress=not args.no_progress)
    return finish(args, result, format_descids(result), None)


def add_parser(sub: Any) -> None:
    """`hybrid-pd bench descids`."""
    d = sub.add_parser(
        "descids",
        help="micro-benchmark of per-request descriptor ids (read_indices)",
        description=doc("hybridpd_tools.bench.descids"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add(d, "model", "nemotron-3-nano-30b-a3b", "model preset", metavar="PRESET")
    add(d, "blocks", 100_000, "kernel blocks of the request, in every attention group", type=positive, metavar="B")
    tp_flags(d)
    add(d, "kernel-block-size", 16, "attention kernel block size, both sides", type=positive, metavar="TOKENS")
    add(d, "repeat", 30, "timed calls", type=positive, metavar="N")
    common(d, plot=False)
    d.set_defaults(func=guarded(run))
