"""`hybrid-pd`: the command-line front door (models, plan, generate, demo, bench)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared.cli import bench_cmd, demo_cmd, generate_cmd, layout_cmds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-pd",
        description=(
            "Prefill/decode disaggregation for hybrid SSM + attention models. "
            "Every flag can also be given as an environment variable HYBRID_PD_<FLAG>."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    layout_cmds.register(sub)
    generate_cmd.register(sub)
    demo_cmd.register(sub)
    bench_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
