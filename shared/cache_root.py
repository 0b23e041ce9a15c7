"""Where hybrid-pd keeps what it makes once per machine and reuses (tiny checkpoints, built
kernels): one root for all of it, so one variable moves or isolates every cache."""

from __future__ import annotations

import os


def cache_root() -> str:
    """$HYBRID_PD_CACHE, else $XDG_CACHE_HOME/hybrid-pd, else ~/.cache/hybrid-pd."""
    explicit = os.environ.get("HYBRID_PD_CACHE")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "hybrid-pd")
