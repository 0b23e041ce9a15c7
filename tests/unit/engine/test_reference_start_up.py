"""The reference engine's determinism switches turn on torch's deterministic kernels without
loading torch's compiler: `torch.use_deterministic_algorithms` imports the compiler's config, and
with it the whole compiler stack (seconds at every start of a service running this engine)."""

from __future__ import annotations

import subprocess
import sys

COMPILER = ("torch._dynamo", "torch._inductor", "sympy")

FRESH_PROCESS = """
import sys
import torch
{switch}
print(torch.are_deterministic_algorithms_enabled(), torch.get_deterministic_debug_mode())
print(sorted(m for m in {compiler!r} if m in sys.modules))
"""


def _run(switch: str) -> tuple[str, str]:
    code = FRESH_PROCESS.format(switch=switch, compiler=COMPILER)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    modes, loaded = out.stdout.strip().splitlines()
    return modes, loaded


def test_the_switches_turn_deterministic_kernels_on_without_the_compiler() -> None:
    modes, loaded = _run("from shared.engine.reference import configure_determinism\nconfigure_determinism()")
    assert modes == "True 2"  # on, and an op without a deterministic kernel raises
    assert loaded == "[]"


def test_the_probe_sees_the_compiler_that_torchs_own_switch_loads() -> None:
    """Negative control: the call configure_determinism avoids does load the compiler, so the
    test above would see it."""
    modes, loaded = _run("torch.use_deterministic_algorithms(True)")
    assert modes == "True 2"
    assert "torch._inductor" in loaded
