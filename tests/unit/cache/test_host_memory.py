"""Host buffers on transparent huge pages: aligned, zeroed, alive as long as the tensor, and
really backed by huge pages where the kernel grants them (checked in /proc/self/smaps)."""

from __future__ import annotations

import errno
import gc
import mmap
import re
from pathlib import Path

import pytest
import torch

from shared.cache.host_memory import HUGE_PAGE_BYTES, host_buffer
from shared.cache.regions import RankCache

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP mode (`always`, `madvise`, `never`), None where it has no THP."""
    try:
        found = re.search(r"\[(\w+)\]", THP_MODE.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, in KiB."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span[1], 16) <= address < int(span[2], 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_huge_page_buffer_is_aligned_zeroed_and_exactly_sized() -> None:
    nbytes = 3 * HUGE_PAGE_BYTES + 12345
    buffer = host_buffer(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.numel() == nbytes and buffer.is_contiguous()
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(buffer.count_nonzero()) == 0


def test_the_tensor_keeps_its_mapping_alive() -> None:
    buffer = host_buffer(2 * HUGE_PAGE_BYTES)
    gc.collect()  # nothing but the tensor refers to the mapping now
    buffer[-4096:] = 7
    assert int(buffer[-4096:].sum()) == 7 * 4096 and int(buffer[:4096].sum()) == 0


def test_small_buffers_and_off_are_plain_memory() -> None:
    small = host_buffer(4096)
    assert small.numel() == 4096 and int(small.count_nonzero()) == 0
    plain = host_buffer(4 * HUGE_PAGE_BYTES, huge_pages=False)
    assert plain.numel() == 4 * HUGE_PAGE_BYTES and int(plain.count_nonzero()) == 0
    assert plain.data_ptr() % HUGE_PAGE_BYTES != 0  # torch's own allocation, not the aligned mapping
    with pytest.raises(ValueError, match="at least one byte"):
        host_buffer(0)


def test_a_kernel_that_refuses_the_advice_still_gets_a_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    advised: list[tuple[int, ...]] = []

    class NoThp(mmap.mmap):  # a stand-in for a kernel built without THP: madvise fails with EINVAL
        def madvise(self, *args: int) -> None:
            advised.append(args)
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", NoThp)
    buffer = host_buffer(2 * HUGE_PAGE_BYTES)
    assert advised and advised[0][0] == mmap.MADV_HUGEPAGE  # the advice was asked, and refused
    assert buffer.numel() == 2 * HUGE_PAGE_BYTES and int(buffer.count_nonzero()) == 0
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0  # still the aligned mapping, on plain pages


@pytest.mark.skipif(thp_mode() in (None, "never"), reason="this kernel gives no transparent huge pages")
def test_the_kernel_backs_the_buffer_with_huge_pages() -> None:
    nbytes = 8 * HUGE_PAGE_BYTES
    buffer = host_buffer(nbytes)
    assert huge_kib(buffer.data_ptr()) >= nbytes // 1024
    if thp_mode() == "madvise":  # negative control: memory that does not ask gets none
        plain = host_buffer(nbytes, huge_pages=False)
        assert huge_kib(plain.data_ptr()) == 0


def test_rank_cache_regions_follow_the_setting() -> None:
    on = RankCache(2, 4, HUGE_PAGE_BYTES)
    assert all(r.data_ptr() % HUGE_PAGE_BYTES == 0 for r in on.regions)
    off = RankCache(2, 4, HUGE_PAGE_BYTES, huge_pages=False)
    assert all(r.data_ptr() % HUGE_PAGE_BYTES for r in off.regions)  # torch's allocation, not ours
    assert [r.numel() for r in off.regions] == [r.numel() for r in on.regions] == [4 * HUGE_PAGE_BYTES] * 2
