"""`hybrid-pd bench`: the flag types and helpers every benchmark's parser uses (a flag's default
can come from HYBRID_PD_<FLAG>)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from shared.config import ENV_PREFIX, boolean


def env_default(flag: str, default: Any) -> Any:
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def on_off(text: str) -> str:
    """The services' --huge-pages values (on/off, true/false, 1/0, yes/no), spelled on|off."""
    try:
        return "on" if boolean(text) else "off"
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}, got {text!r}") from None


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def levels(text: str) -> tuple[int, ...]:
    from hybridpd_tools.bench.e2e import parse_levels

    try:
        return parse_levels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def lengths(text: str) -> tuple[int, ...]:
    from hybridpd_tools.bench.e2e import parse_levels

    try:
        return parse_levels(text, "prompt length")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add(p: argparse.ArgumentParser, flag: str, default: Any, help: str, **kw: Any) -> None:
    """A flag whose default can come from HYBRID_PD_<FLAG> (parsed by `type` like a typed value)."""
    env = ENV_PREFIX + flag.upper().replace("-", "_")
    shown = "" if default is None else f"; default {default}"
    p.add_argument(f"--{flag}", default=env_default(flag, default), help=f"{help} (env {env}{shown})", **kw)


def common(p: argparse.ArgumentParser, plot: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    if plot:
        add(p, "plot", None, "write a chart here, PNG or SVG by the suffix (needs matplotlib: the plot extra)", metavar="FILE")


def tp_flags(p: argparse.ArgumentParser) -> None:
    add(p, "prefill-tp", 1, "prefill TP size", type=positive, metavar="P")
    add(p, "decode-tp", 1, "decode TP size", type=positive, metavar="D")


def doc(module: str) -> str:
    """A module's docstring as a subcommand's description, without importing torch or NIXL for --help."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    import ast

    with open(spec.origin) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""
