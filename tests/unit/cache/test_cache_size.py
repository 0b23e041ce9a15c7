"""Cache sizing: a size larger than the memory the ranks live in is refused with the numbers,
naming the flag, in the library and from a real service process (exit 2, one line)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.errors import InvalidArgument
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout
from shared.runtime.cache_size import MemoryLimit, block_bytes, cache_blocks, host_memory_bytes, memory_limit

LAYOUT = build_engine_layout(load_model("tiny-mamba2"), 1)


def test_host_memory_is_memtotal(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemFree:         1000 kB\n")
    assert host_memory_bytes(str(meminfo)) == 24684084 * 1024
    assert host_memory_bytes(str(tmp_path / "absent")) is None
    real = host_memory_bytes()
    assert real is not None and real > 0  # this machine's /proc/meminfo


def test_tp_ranks_share_the_host(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8388608 kB\n")  # 8 GiB
    one, four = memory_limit("cpu", 1, meminfo=str(meminfo)), memory_limit("cpu", 4, meminfo=str(meminfo))
    assert one is not None and four is not None
    assert (one.per_rank, four.per_rank) == (8 << 30, 2 << 30)
    assert "8.0 GiB" in four.source and "shared by 4 ranks" in four.source


def test_a_budget_over_the_host_names_the_flag_and_the_numbers() -> None:
    limit = MemoryLimit(4 << 30, "this host has 4.0 GiB (MemTotal in /proc/meminfo)")
    with pytest.raises(InvalidArgument) as e:
        cache_blocks(LAYOUT, None, 6 << 30, limit)
    assert e.value.fields == ("--memory-budget",)
    assert "6.0 GiB" in e.value.message and "this host has 4.0 GiB" in e.value.message
    # Negative control: a budget that fits gives its block count.
    assert cache_blocks(LAYOUT, None, 3 << 30, limit) == (3 << 30) // block_bytes(LAYOUT)


def test_a_block_count_over_the_host_names_num_blocks() -> None:
    limit = MemoryLimit(64 << 20, "cuda:0 has 64.0 MiB in total")
    fits = (64 << 20) // block_bytes(LAYOUT)
    assert cache_blocks(LAYOUT, fits, None, limit) == fits
    with pytest.raises(InvalidArgument) as e:
        cache_blocks(LAYOUT, fits + 1, None, limit)
    assert e.value.fields == ("--num-blocks",) and "cuda:0 has 64.0 MiB" in e.value.message


def test_the_service_refuses_a_budget_over_memtotal_in_one_line() -> None:
    total = host_memory_bytes()
    assert total is not None
    budget = 2 * total
    proc = subprocess.run(
        [sys.executable, "-m", "prefill_svc", "--port", "0", "--memory-budget", str(budget), "--engine-id", "too-big"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.getcwd()},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "LISTENING" not in proc.stdout
    assert re.fullmatch(r"prefill-svc: INVALID_ARGUMENT: --memory-budget: .*", lines[-1]), lines[-1]
    assert f"this host has {total / (1 << 30):.1f} GiB (MemTotal in /proc/meminfo)" in lines[-1]
