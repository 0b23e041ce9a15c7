from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.cache.memory_place import MemoryPlace
from shared.transport.memory import nixl_descs


def test_cpu_tensors_are_dram_device_zero() -> None:
    assert MemoryPlace.of_tensors([torch.zeros(4), torch.zeros(8)]) == MemoryPlace("DRAM", 0)


def test_tensors_off_cpu_and_cuda_are_refused() -> None:
    with pytest.raises(ValueError, match="meta"):
        MemoryPlace.of_tensors([torch.empty(4, device="meta")])
    with pytest.raises(ValueError, match="share a device"):
        MemoryPlace.of_tensors([torch.zeros(4), torch.empty(4, device="meta")])
    with pytest.raises(ValueError):
        MemoryPlace.of_tensors([])


def test_nx2_descriptors_gain_the_device_id() -> None:
    descs = np.array([[4096, 100], [8192, 200]], dtype=np.int64)
    rows = nixl_descs(descs, MemoryPlace("VRAM", 3))
    assert rows.dtype == np.uint64
    assert rows.tolist() == [[4096, 100, 3], [8192, 200, 3]]


@pytest.mark.parametrize(
    "bad",
    [np.zeros((0, 2), np.int64), np.zeros((3, 3), np.int64), np.zeros(4, np.int64), np.array([[1.0, 2.0]]), np.array([[-1, 5]])],
)
def test_malformed_descriptors_are_refused(bad: np.ndarray) -> None:
    with pytest.raises(ValueError):
        nixl_descs(bad, MemoryPlace("DRAM", 0))
