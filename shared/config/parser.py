"""The argparse parser of each service, built from the flag table."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from shared.config.flags import DEFAULT_PORTS, ENV_PREFIX, Role, flags_for
from shared.config.values import port_number, positive_float, positive_int
from shared.version import version

_METAVARS: dict[Callable[[str], object], str] = {positive_int: "N", positive_float: "SECONDS", port_number: "PORT"}


def build_parser(role: Role) -> argparse.ArgumentParser:
    prog = f"{role}-svc"
    description = {
        "prefill": "The hybrid-pd prefill service: computes a request's KV cache and SSM state into "
        "paged blocks and lets decode engines READ them with NIXL.",
        "decode": "The hybrid-pd decode service: takes Generate requests, gets the prompt's state "
        "from a prefill service with one NIXL READ per (local rank, source rank), and generates tokens.",
    }[role]
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"Every flag can also be set with an environment variable {ENV_PREFIX}<FLAG> "
        f"(upper case, '-' -> '_'); a flag on the command line wins over the environment.",
    )
    parser.add_argument("--version", action="version", version=f"{prog} {version()}")
    for flag in flags_for(role):
        default = DEFAULT_PORTS[role] if flag.name == "port" else flag.default
        options = getattr(flag.parse, "options", None)
        metavar = flag.metavar or ("{" + ",".join(options) + "}" if options else _METAVARS.get(flag.parse))
        if isinstance(default, bool) and not flag.switch:
            default = "on" if default else "off"
        shown = f"; default {default}" if default is not None else ""
        help_text = f"{flag.help} (env {flag.env}{shown})"
        if flag.switch:
            parser.add_argument(
                f"--{flag.name}", dest=flag.dest, action="store_const", const="true", default=None, help=help_text
            )
            continue
        parser.add_argument(
            f"--{flag.name}",
            dest=flag.dest,
            action="append" if flag.repeatable else "store",
            default=None,
            metavar=metavar,
            help=help_text,
        )
    return parser


def other_service_flag(role: Role, argv: Sequence[str]) -> str | None:
    """The message for the first flag in `argv` that only the other service takes, else None
    (argparse alone would call it "unrecognized", as if it were a typo)."""
    other: Role = "decode" if role == "prefill" else "prefill"
    theirs = {f"--{f.name}" for f in flags_for(other) if role not in f.roles}
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name in theirs:
            return f"{name} is a {other}-svc flag; {role}-svc does not take it"
    return None
