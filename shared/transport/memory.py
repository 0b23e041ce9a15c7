"""Where registered memory lives, and descriptor lists in the form NIXL takes.

The layout math describes memory as Nx2 int64 arrays of (address, length); NIXL wants
Nx3 (address, length, device id) plus a memory type. The device id and memory type are
a property of the rank's memory, so they travel once per rank in the handshake.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

MemType = Literal["DRAM", "VRAM"]


@dataclass(frozen=True)
class MemoryPlace:
    """A rank's memory: host DRAM (device id 0) or the VRAM of one GPU."""

    mem_type: MemType
    device_id: int

    @staticmethod
    def of_tensors(tensors: Sequence[torch.Tensor]) -> MemoryPlace:
        """The place of a set of tensors that must all live on one device."""
        if not tensors:
            raise ValueError("no tensors given")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"tensors of one rank must share a device, got {sorted(map(str, devices))}")
        device = tensors[0].device
        if device.type == "cpu":
            return MemoryPlace("DRAM", 0)
        if device.type == "cuda":
            return MemoryPlace("VRAM", 0 if device.index is None else device.index)
        raise ValueError(f"NIXL cannot register memory on device {device}")


def nixl_descs(descs: npt.ArrayLike, place: MemoryPlace) -> npt.NDArray[np.uint64]:
    """Nx2 (address, length) -> the Nx3 uint64 (address, length, device id) array NIXL takes."""
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"descriptors must be an Nx2 (address, length) array, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("descriptor list is empty")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"descriptors must be integers, got {arr.dtype}")
    if np.any(arr < 0):
        raise ValueError("descriptors hold a negative address or length")
    out = np.empty((arr.shape[0], 3), dtype=np.uint64)
    out[:, :2] = arr
    out[:, 2] = place.device_id
    return out
