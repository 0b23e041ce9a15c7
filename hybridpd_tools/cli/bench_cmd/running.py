"""`hybrid-pd bench`: what every benchmark's run shares: the command line that reproduces it, its
event loop, its output (table or JSON, and a chart) and its exit code."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any


def command_line(name: str, args: argparse.Namespace, flags: Sequence[str]) -> str:
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


def run_async(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def finish(
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


def guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
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
