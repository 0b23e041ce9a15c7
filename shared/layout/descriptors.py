"""Descriptor lists of registered cache memory: `(addr, len)` rows for every region, piece
and block, built in one numpy pass (the read lists in `read_lists` are made of them).

The reference view of vLLM's documented order (layout-spec section 3.3, region-major: every
block of one (region, piece) consecutive) is kept beside the tests that compare the read lists
against it; the data path lists descriptors block-major instead (`block_major=True`), so that
NIXL can merge the descriptors of contiguous blocks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


def region_descriptors(
    bases: IntArray,
    piece_offsets: IntArray,
    piece_sizes: IntArray,
    block_offsets: IntArray,
    out: IntArray | None = None,
    *,
    block_major: bool = False,
) -> IntArray:
    """`(addr, len)` rows for every region, piece and block, in that order (block fastest); with
    `block_major`, for every region, block and piece (piece fastest: the pieces of one block get
    consecutive rows, which NIXL merges when they are adjacent in memory).

    Written straight into `out` (shape `(R·Q·N, 2)`) when given: lists of millions of
    descriptors are built without intermediate copies.
    """
    num = len(bases) * len(piece_offsets) * len(block_offsets)
    if out is None:
        out = np.empty((num, 2), dtype=np.int64)
    if block_major:
        view = out.reshape(len(bases), len(block_offsets), len(piece_offsets), 2)
        np.add((bases[:, None] + block_offsets[None, :])[:, :, None], piece_offsets[None, None, :], out=view[..., 0])
        view[..., 1] = piece_sizes[None, None, :]
    else:
        view = out.reshape(len(bases), len(piece_offsets), len(block_offsets), 2)
        np.add((bases[:, None] + piece_offsets[None, :])[:, :, None], block_offsets[None, None, :], out=view[..., 0])
        view[..., 1] = piece_sizes[None, :, None]
    return out
