"""Where a rank's cache memory lives: host DRAM or the VRAM of one GPU (NIXL's memory type and
device id, sent once per rank in the handshake)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
