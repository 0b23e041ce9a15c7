"""How many cache blocks an engine gets, checked against the memory its ranks live in.

`--num-blocks` gives the count; `--memory-budget` gives bytes per rank (the count follows from the
page size). With neither, the cache is sized from the model: enough blocks for
`DEFAULT_REQUESTS` requests of `DEFAULT_REQUEST_TOKENS` tokens each, but at most
`DEFAULT_MEMORY_FRACTION` of the memory the ranks live in (host DRAM shared by all ranks for
`--device cpu`, each rank's GPU for `--device cuda`). A size larger than that memory is refused
at start with the numbers, instead of the allocator's out-of-memory error.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import InvalidArgument
from shared.layout.page import EngineLayout

DEFAULT_REQUESTS = 8
DEFAULT_REQUEST_TOKENS = 8192
DEFAULT_MEMORY_FRACTION = 0.25
MEMINFO = "/proc/meminfo"


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes available to ONE rank's cache and where the number comes from (for messages)."""

    per_rank: int
    source: str


def host_memory_bytes(meminfo: str = MEMINFO) -> int | None:
    """MemTotal of this host, in bytes; None where the file does not say."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_limit(device: str, tp: int, *, meminfo: str = MEMINFO) -> MemoryLimit | None:
    """What one rank's cache may use at most: host MemTotal split over the TP ranks (they share
    this host), or the smallest total memory of the GPUs the ranks use; None when unknown."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < tp:
            return None  # the allocation itself says so
        totals = [int(torch.cuda.get_device_properties(r).total_memory) for r in range(tp)]
        smallest = min(range(tp), key=lambda r: totals[r])
        return MemoryLimit(totals[smallest], f"cuda:{smallest} has {gib(totals[smallest])} in total")
    total = host_memory_bytes(meminfo)
    if total is None:
        return None
    shared = f" shared by {tp} ranks" if tp > 1 else ""
    return MemoryLimit(total // tp, f"this host has {gib(total)} (MemTotal in {meminfo}){shared}")


def gib(nbytes: int) -> str:
    """Bytes for a reader: MiB below 1 GiB, else GiB (one decimal)."""
    if nbytes < 1 << 30:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / (1 << 30):.1f} GiB"


def block_bytes(layout: EngineLayout) -> int:
    """One logical block on one rank: a page in every region."""
    return layout.page_bytes * layout.num_regions


def model_default_blocks(layout: EngineLayout) -> int:
    """Blocks for DEFAULT_REQUESTS requests of DEFAULT_REQUEST_TOKENS tokens of this model."""
    return DEFAULT_REQUESTS * sum(layout.blocks_per_group(DEFAULT_REQUEST_TOKENS))


def cache_blocks(layout: EngineLayout, num_blocks: int | None, memory_budget: int | None, limit: MemoryLimit | None) -> int:
    """Logical blocks per engine from --num-blocks, --memory-budget or the model's default,
    refused (INVALID_ARGUMENT naming the flag) when one rank's share does not fit `limit`."""
    per_block = block_bytes(layout)
    if num_blocks is not None:
        flag, blocks = "--num-blocks", num_blocks
        asked = f"{num_blocks} blocks of {per_block} B ({gib(num_blocks * per_block)} per rank) are"
    elif memory_budget is not None:
        flag, blocks = "--memory-budget", memory_budget // per_block
        asked = f"{gib(memory_budget)} per rank is"
        if blocks < 1:
            raise InvalidArgument(
                f"{memory_budget} B per rank holds no block: one block is {per_block} B "
                f"({layout.num_regions} regions x {layout.page_bytes} B pages)",
                field=flag,
            )
    else:
        blocks = model_default_blocks(layout)
        if limit is not None:
            blocks = min(blocks, int(limit.per_rank * DEFAULT_MEMORY_FRACTION) // per_block)
        if blocks < 1:
            raise InvalidArgument(
                f"one block of {layout.spec.name} is {per_block} B, more than {DEFAULT_MEMORY_FRACTION:.0%} of the "
                f"memory ({limit.source if limit else 'unknown'}); give the size with --num-blocks or --memory-budget",
                field="--memory-budget",
            )
        return blocks
    if limit is not None and blocks * per_block > limit.per_rank:
        raise InvalidArgument(
            f"{asked} more than the memory there is: {limit.source}, at most {gib(limit.per_rank)} per rank",
            field=flag,
        )
    return int(blocks)


def capacity_line(layout: EngineLayout, num_blocks: int, max_request_tokens: int) -> str:
    """The start-up line an operator reads to know what the cache holds."""
    return (
        f"capacity: {num_blocks} blocks of {layout.block_size} tokens ({gib(num_blocks * block_bytes(layout))} per rank); "
        f"one request holds at most {max_request_tokens} tokens"
    )
