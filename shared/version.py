"""The installed hybrid-pd version (for --version, /version and build info)."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("hybrid-pd")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
