"""scripts/bench_vs_vllm.py's CPU accounting, read from /proc: a process tree's CPU time over
all its threads, and its main thread's alone. Real processes that burn a known amount of CPU
(each spins until its own clock says so, then reports and sleeps), so nothing depends on how
busy the machine is."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "bench_vs_vllm.py"
SPIN_SECONDS = 0.5
TICK = 1 / os.sysconf("SC_CLK_TCK")
WHERE = ("main thread", "other thread", "child process")

# Burns SPIN_SECONDS of CPU where argv[1] says, prints "spun", then sleeps until killed. A child
# process is this same program run again with "main thread" (argv[2] is the program's text).
SPINNER = f"""
import subprocess, sys, threading, time

def spin(clock):
    while clock() < {SPIN_SECONDS}:
        pass

where, program = sys.argv[1], sys.argv[2]
if where == "main thread":
    spin(time.thread_time)
elif where == "other thread":
    worker = threading.Thread(target=spin, args=(time.thread_time,))
    worker.start()
    worker.join()
else:
    child = subprocess.Popen([sys.executable, "-c", program, "main thread", program], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "spun"
print("spun", flush=True)
time.sleep(60)
"""


def bench_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vs_vllm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@contextmanager
def spun(where: str) -> Iterator[int]:
    """A process that has burnt SPIN_SECONDS of CPU `where`; its pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SPINNER, where, SPINNER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "spun"
        yield proc.pid
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.parametrize("where", WHERE)
def test_cpu_ticks_counts_every_thread_and_child_and_the_main_thread_apart(where: str) -> None:
    cpu_ticks = bench_script().cpu_ticks
    with spun(where) as pid:
        total, main = cpu_ticks(pid)
    assert total * TICK >= SPIN_SECONDS - 2 * TICK
    if where == "main thread":
        assert main * TICK >= SPIN_SECONDS - 2 * TICK
    else:  # the main thread only started the spinner (an interpreter's start-up: well under the spin)
        assert main * TICK < SPIN_SECONDS / 2 + 2 * TICK and main < total


def test_a_gone_process_counts_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert bench_script().cpu_ticks(proc.pid) == (0, 0)
