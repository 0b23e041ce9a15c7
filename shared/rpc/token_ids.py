"""A request's token ids: from a message's repeated field, and checked against the vocabulary,
without one Python step per id where it can be helped.

`list(message.prompt_token_ids)` boxes every id on its own; the protobuf container hands numpy
all of them in one copy, and `tolist()` then builds the list in C. On a long prompt that is the
difference between about half a millisecond and a tenth of one, on every request's path (decode
takes the client's prompt, prefill the job's)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from shared.errors import InvalidArgument


def token_array(ids: Iterable[int]) -> npt.NDArray[np.int64]:
    """The ids as int64 (a repeated uint32 field: one copy, no Python objects)."""
    return np.asarray(ids, dtype=np.int64)


def token_list(ids: Iterable[int]) -> list[int]:
    """The ids as a list of Python ints."""
    listed: list[int] = token_array(ids).tolist()
    return listed


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
