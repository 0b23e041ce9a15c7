"""Descriptor lists in the form NIXL takes.

The layout math describes memory as Nx2 int64 arrays of (address, length); NIXL wants
Nx3 (address, length, device id) plus a memory type. The device id and memory type are
a property of the rank's memory (`MemoryPlace`, shared/cache/memory_place.py), so they travel
once per rank in the handshake.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from shared.cache.memory_place import MemoryPlace


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
