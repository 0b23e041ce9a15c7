"""Loads NIXL once, with the environment defaults this project relies on.

UCX and NIXL read their environment when the library is imported and an agent is
created, so the defaults must be in place before the first import: call
`load_nixl()` early (service start-up, test fixtures) and import NIXL only through it.
Every default is set with `setdefault`, so a value the user exported wins.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

NIXL_ENV_DEFAULTS: dict[str, str] = {
    # Under UCX's default `peer` error mode the shared-memory transports are excluded, so
    # wire-up and notifications go over TCP loopback. This keeps peer-failure detection and
    # moves them to shared memory: notification round trip 19 us -> 3.4 us, first READ
    # 10-18 ms -> 2.4 ms, and a SIGKILLed peer is still reported (cma carries the data).
    "UCX_MM_ERROR_HANDLING": "y",
    # NIXL's Python logger prints INFO lines to stdout by default; services keep stdout clean.
    "NIXL_LOG_LEVEL": "WARN",
}

# Tried in this order. The meta package `nixl` picks the wheel matching the CUDA runtime;
# the direct wheel is the fallback for CPU-only installs that only have `nixl-cu12`.
_API_MODULES = ("nixl._api", "nixl_cu12._api")
# Two wheels cannot share a process (their bindings register the same C++ types), so a
# wheel that is already loaded is always reused.
_WHEEL_API_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")

# One class per NIXL status, no common base class: collected by name from the bindings.
_ERROR_NAMES = (
    "nixlNotPostedError",
    "nixlInvalidParamError",
    "nixlBackendError",
    "nixlNotFoundError",
    "nixlMismatchError",
    "nixlNotAllowedError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlNotSupportedError",
    "nixlRemoteDisconnectError",
    "nixlCancelledError",
    "nixlNoTelemetryError",
)


@dataclass(frozen=True)
class NixlApi:
    """The loaded NIXL Python API: the module, its agent classes and its exception types."""

    module: ModuleType
    nixl_agent: Any
    nixl_agent_config: Any
    errors: tuple[type[BaseException], ...]

    def error_named(self, name: str) -> type[BaseException]:
        """The exception class for a NIXL status name, e.g. `nixlNotAllowedError`."""
        for cls in self.errors:
            if cls.__name__ == name:
                return cls
        raise KeyError(name)


_loaded: NixlApi | None = None


def apply_env_defaults(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set every default the environment does not already define; returns the ones set."""
    target = os.environ if env is None else env
    applied: dict[str, str] = {}
    for key, value in NIXL_ENV_DEFAULTS.items():
        if key not in target:
            target[key] = value
            applied[key] = value
    return applied


def load_nixl() -> NixlApi:
    """Apply the environment defaults, import NIXL (once) and return its API."""
    global _loaded
    if _loaded is not None:
        return _loaded
    apply_env_defaults()
    module = _import_api_module()
    bindings = module.nixlBind
    errors = tuple(getattr(bindings, name) for name in _ERROR_NAMES if hasattr(bindings, name))
    _loaded = NixlApi(
        module=module,
        nixl_agent=module.nixl_agent,
        nixl_agent_config=module.nixl_agent_config,
        errors=errors,
    )
    return _loaded


def _import_api_module() -> ModuleType:
    for name in _WHEEL_API_MODULES:
        already = sys.modules.get(name)
        if already is not None:
            return already
    failures: list[str] = []
    for name in _API_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
    raise ImportError(
        "NIXL is not installed or cannot be loaded; install `nixl-cu12` (CPU hosts and "
        "CUDA 12) or `nixl` (picks the wheel for the CUDA runtime). Tried: " + "; ".join(failures)
    )
