"""Cache sizing: the default follows the model (DEFAULT_REQUESTS requests of
DEFAULT_REQUEST_TOKENS tokens, at most a fraction of memory) and start-up says what it holds; a
size larger than the memory the ranks live in is refused with the numbers, naming the flag, in
the library and from a real service process (exit 2, one line)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpd_tools.bench.local_pair import start_service
from shared.cache.cache_size import (
    DEFAULT_MEMORY_FRACTION,
    DEFAULT_REQUEST_TOKENS,
    DEFAULT_REQUESTS,
    MemoryLimit,
    block_bytes,
    cache_blocks,
    host_memory_bytes,
    memory_limit,
)
from shared.errors import InvalidArgument
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout

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


@pytest.mark.parametrize("model", ["tiny-mamba2", "tiny-gdn", "nemotron-3-nano-30b-a3b", "falcon-h1-7b"])
def test_the_default_size_holds_the_default_requests_of_the_model(model: str) -> None:
    layout = build_engine_layout(load_model(model), 1)
    roomy = MemoryLimit(1 << 40, "a host of 1 TiB")
    blocks = cache_blocks(layout, None, None, roomy)
    one_request = sum(layout.blocks_per_group(DEFAULT_REQUEST_TOKENS))
    assert blocks == DEFAULT_REQUESTS * one_request
    # Negative control: one request more would not fit.
    assert blocks < (DEFAULT_REQUESTS + 1) * one_request


def test_the_default_size_is_bounded_by_a_fraction_of_memory() -> None:
    layout = build_engine_layout(load_model("nemotron-3-nano-30b-a3b"), 1)
    small = MemoryLimit(1 << 30, "this host has 1.0 GiB")
    blocks = cache_blocks(layout, None, None, small)
    assert blocks == int((1 << 30) * DEFAULT_MEMORY_FRACTION) // block_bytes(layout)
    assert blocks < DEFAULT_REQUESTS * sum(layout.blocks_per_group(DEFAULT_REQUEST_TOKENS))
    tiny = MemoryLimit(block_bytes(layout), "a host of one block")
    with pytest.raises(InvalidArgument, match="give the size with --num-blocks or --memory-budget"):
        cache_blocks(layout, None, None, tiny)


def test_start_up_prints_the_engine_and_the_capacity_in_one_line() -> None:
    """A real prefill-svc without --engine or a cache size: the reference engine (tiny-mamba2),
    and one line with the block count, block size and the longest request."""
    service = start_service("prefill", ["--model", "tiny-mamba2", "--engine-id", "capacity", "--loop", "asyncio"])
    try:
        capacity = [line for line in service.output if "capacity:" in line]
        engine = [line for line in service.output if "engine reference (chosen by --model" in line]
    finally:
        assert service.stop() == 0
    one_request = sum(LAYOUT.blocks_per_group(DEFAULT_REQUEST_TOKENS))
    blocks = DEFAULT_REQUESTS * one_request
    # Every Mamba group takes one block; the rest is shared by the attention groups.
    longest = (blocks - len(LAYOUT.mamba_group_ids)) // len(LAYOUT.attention_group_ids) * LAYOUT.block_size
    assert len(capacity) == 1 and len(engine) == 1, service.output
    assert f"capacity: {blocks} blocks of {LAYOUT.block_size} tokens" in capacity[0]
    assert f"one request holds at most {longest} tokens" in capacity[0]
    assert "(default size: see --num-blocks in --help)" in capacity[0]
