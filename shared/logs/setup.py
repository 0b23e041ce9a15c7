"""Logging of one service process: one stderr handler (stdout carries only the lines scripts
parse), the chosen format, and the rate limit on repeated warnings."""

from __future__ import annotations

import logging
import sys

from shared.logs.formats import formatter_for
from shared.logs.rate_limit import RateLimitFilter


def configure_logging(level: str, fmt: str = "text", *, service: str = "", engine_id: str = "") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter_for(fmt, service, engine_id))
    handler.addFilter(RateLimitFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
