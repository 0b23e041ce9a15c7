"""Our output is ours: what transformers / huggingface_hub print goes through our logger.

`transformers_module()` is the one way this code base imports transformers. Before the import
it turns off the progress bars of transformers and huggingface_hub ("Loading weights", "Writing
model shards": tqdm on stderr) unless stderr is a terminal and the user asked for them with
`HF_HUB_DISABLE_PROGRESS_BARS=0`. After it, transformers' own stderr handler is replaced by one
that re-logs each record through the `shared.third_party` logger (our handlers, our format, the
JSON lines of `--log-format json` included).

transformers warns, once per kernel function, that it falls back to its reference PyTorch
implementation because a kernel package (causal_conv1d, flash-linear-attention, mamba-ssm) is not
installed. On a CPU machine that is expected, so those records are collected and said once, at
INFO, naming what to install (`kernel_fallbacks_note`, called after each model call; a package
not named before gets a line of its own).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from types import ModuleType
from typing import Any

log = logging.getLogger("shared.third_party")

PROGRESS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"
_KERNEL_FALLBACK = re.compile(
    r"`(?P<function>[^`]+)` is falling back to its reference PyTorch implementation because `(?P<package>[^`]+)` is not installed"
)
# Older transformers (and some model files) say it this way: "The fast path is not available ...".
_FAST_PATH = re.compile(r"fast path is not available", re.IGNORECASE)


def progress_bars_wanted() -> bool:
    """Library progress bars only on a terminal, and only when asked for."""
    asked = os.environ.get(PROGRESS_ENV, "").strip().lower() in ("0", "false", "no", "off")
    return asked and sys.stderr is not None and sys.stderr.isatty()


def quiet_progress_bars() -> None:
    """Before huggingface_hub / transformers are imported (they read the variable then), and
    again after (in case something imported them first)."""
    if progress_bars_wanted():
        return
    os.environ[PROGRESS_ENV] = "1"
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None:
        hub.disable_progress_bars()
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None:
        tf_logging.disable_progress_bar()


class KernelFallbacks:
    """The kernel packages transformers fell back from, by package: the functions, and whether
    our INFO line named the package yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.functions: dict[str, list[str]] = {}
        self.named: set[str] = set()
        self.fast_path: str | None = None  # an old-style "fast path is not available" message
        self.pending = False  # something new to say (read without the lock: a model call checks it)

    def add(self, message: str) -> bool:
        """True when `message` is a fallback warning (then it is kept here, not printed)."""
        found = _KERNEL_FALLBACK.search(message)
        with self._lock:
            if found is not None:
                self.functions.setdefault(found["package"], []).append(found["function"])
                self.pending = self.pending or found["package"] not in self.named
                return True
            if _FAST_PATH.search(message):
                self.fast_path = self.fast_path or message
                self.pending = True
                return True
        return False

    def note(self) -> str | None:
        """One line for the packages not named yet (None: nothing new)."""
        with self._lock:
            self.pending = False
            new = [p for p in self.functions if p not in self.named]
            fast_path, self.fast_path = self.fast_path, None
            self.named.update(new)
            if not new and fast_path is None:
                return None
            if not new:
                assert fast_path is not None
                return f"transformers runs a slower PyTorch path (expected without GPU kernels): {fast_path}"
            what = "; ".join(f"`{p}` for {', '.join(self.functions[p])}" for p in new)
            return (
                f"transformers runs its reference PyTorch kernels (correct but slower; expected where the kernel "
                f"packages are not installed): missing {what}. For the optimized kernels: pip install {' '.join(new)}"
            )


FALLBACKS = KernelFallbacks()


class ToOurLogger(logging.Handler):
    """transformers' handler: kernel fallbacks are collected, everything else re-logged as ours."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if FALLBACKS.add(message):
                return
            log.log(record.levelno, "%s: %s", record.name, message)
        except Exception:
            self.handleError(record)


_HANDLER = ToOurLogger()
_tamed = False
_tame_lock = threading.Lock()


def kernel_fallbacks_note() -> None:
    """Say, once, what the fallbacks seen so far ask to install (call after a model call)."""
    if not FALLBACKS.pending:
        return
    line = FALLBACKS.note()
    if line is not None:
        log.info(line)


def tame(transformers: Any) -> None:
    """Route transformers' logger through ours (idempotent)."""
    global _tamed
    with _tame_lock:
        if _tamed:
            return
        tf_logging = transformers.utils.logging
        tf_logging.get_logger()  # configures its library root logger with its own handler, once
        tf_logging.disable_default_handler()
        tf_logging.disable_propagation()  # CI=1 would otherwise send each record to the root too
        library = logging.getLogger("transformers")
        if _HANDLER not in library.handlers:
            library.addHandler(_HANDLER)
        _tamed = True
    quiet_progress_bars()


def transformers_module() -> ModuleType:
    """transformers, imported with its progress bars off and its logs routed through ours."""
    quiet_progress_bars()
    import transformers

    tame(transformers)
    return transformers
