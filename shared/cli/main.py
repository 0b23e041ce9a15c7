"""`hybrid-pd`: the command-line front door (models, plan, generate, demo, bench)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shared.cli import bench_cmd, demo_cmd, generate_cmd, layout_cmds
from shared.layout.spec import LayoutError
from shared.version import version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-pd",
        description=(
            "Prefill/decode disaggregation for hybrid SSM + attention models. "
            "Every flag can also be given as an environment variable HYBRID_PD_<FLAG>."
        ),
    )
    parser.add_argument("--version", action="version", version=f"hybrid-pd {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    layout_cmds.register(sub)
    generate_cmd.register(sub)
    demo_cmd.register(sub)
    bench_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Bad input ends in one line and exit 2, Ctrl-C in one line and exit 130: no tracebacks."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        print(f"hybrid-pd {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, LayoutError, OSError) as e:
        print(f"hybrid-pd {args.command}: error: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
