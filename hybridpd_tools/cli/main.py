"""`hybrid-pd`: the command-line front door (models, plan, generate, demo, bench).

The commands' modules (grpc, numpy, torch behind them) are imported inside `main`, under its
Ctrl-C handling: a Ctrl-C while they load, which takes seconds on a busy machine, ends in the
same one line and exit 130 as one during the command, not in a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn


class OneLineErrors(argparse.ArgumentParser):
    """argparse's refusal of a flag as one line (`hybrid-pd generate: error: argument --seed: ...`)
    and exit 2, without the usage block (`--help` prints it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from hybridpd_tools.cli import bench_cmd, demo_cmd, generate_cmd, layout_cmds
    from shared.version import version

    parser = OneLineErrors(
        prog="hybrid-pd",
        description=(
            "Prefill/decode disaggregation for hybrid SSM + attention models. "
            "Every flag can also be given as an environment variable HYBRID_PD_<FLAG>."
        ),
    )
    parser.add_argument("--version", action="version", version=f"hybrid-pd {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineErrors)
    layout_cmds.register(sub)
    generate_cmd.register(sub)
    demo_cmd.register(sub)
    bench_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Bad input ends in one line and exit 2, Ctrl-C in one line and exit 130: no tracebacks."""
    name = "hybrid-pd"
    try:
        args = build_parser().parse_args(argv)
        name = f"hybrid-pd {args.command}"
        from shared.layout.spec import LayoutError

        try:
            code: int = args.func(args)
        except (ValueError, LayoutError, OSError) as e:
            print(f"{name}: error: {e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
