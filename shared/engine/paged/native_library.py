"""The paged engine's C kernels: built from their source once per machine, loaded with ctypes.

A kernel is one C file beside this one, built by the system's C compiler into a shared library
kept in hybrid-pd's cache (`kernels` under shared/cache_root.py's root) under a name that
carries a digest of the source, the flags and the compiler's version, so a changed source or
compiler builds anew and concurrent builds never read a half-written file (each writes its own
temporary file and renames it into place).
A machine without a C compiler, or a failed build, gets None: the caller keeps its torch path.

The flags forbid contracting a product and a sum into one fused multiply-add and any
reassociation, so a kernel's bits follow its source's order of operations on every machine.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from shared.cache_root import cache_root

log = logging.getLogger(__name__)

# -march=native: the widest vectors this CPU has (a library's name carries the CPU's features, so
# a cache shared by other CPUs never hands one a library it cannot run); the results do not
# change with the vector width, as nothing may be contracted or reassociated.
FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
LIBS = ("-lm",)  # after the source: the linker takes a library for what comes before it


def cache_dir() -> Path:
    return Path(cache_root()) / "kernels"


@cache
def load(name: str) -> ctypes.CDLL | None:
    """The built kernel `name` (`name`.c beside this file), or None where it cannot be built."""
    return build(Path(__file__).with_name(f"{name}.c"))


def build(source: Path) -> ctypes.CDLL | None:
    """The shared library of the C file `source`, built now or found built; None (said in the
    log) where there is no C compiler or the build fails."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler found: the paged engine runs its torch path for %s", source.stem)
        return None
    try:
        return ctypes.CDLL(str(_built(compiler, source)))
    except subprocess.CalledProcessError as e:
        log.warning("building the %s kernel failed: the paged engine runs its torch path\n%s", source.stem, e.stderr)
        return None
    except OSError as e:
        log.warning("the %s kernel cannot be built or loaded (%s): the paged engine runs its torch path", source.stem, e)
        return None


def _built(compiler: str, source: Path) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    key = [source.read_text(), *headers, *FLAGS, *LIBS, version, os.uname().machine, _cpu_features()]
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()
    target = cache_dir() / f"{source.stem}-{digest[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", partial, str(source), *LIBS], capture_output=True, text=True, check=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _cpu_features() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo), what -march=native builds for."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
