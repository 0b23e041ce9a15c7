"""A request's token ids checked against the model's vocabulary, without one Python step per id
where it can be helped (every request's path: decode takes the client's prompt, prefill the job's)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shared.errors import InvalidArgument


def check_token_ids(ids: Sequence[int] | npt.NDArray[np.int64], vocab_size: int, field: str) -> None:
    """InvalidArgument naming `field` and the first id outside the vocabulary, if any."""
    if len(ids) == 0 or _largest(ids) < vocab_size:
        return
    i = int(np.flatnonzero(np.asarray(ids, dtype=np.int64) >= vocab_size)[0])
    raise InvalidArgument(f"token id {ids[i]} at position {i} is outside the vocabulary [0, {vocab_size})", field=field)


def _largest(ids: Sequence[int] | npt.NDArray[np.int64]) -> int:
    """The largest of non-empty `ids`: a list in one C pass (`max`; an array made of it would
    cost more than the pass), an array by numpy."""
    return max(ids) if isinstance(ids, list) else int(np.max(ids))
