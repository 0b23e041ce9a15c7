"""A request's token ids from a message's repeated field, without one Python step per id.

`list(message.prompt_token_ids)` boxes every id on its own; the protobuf container hands numpy
all of them in one copy, and `tolist()` then builds the list in C. On a long prompt that is the
difference between about half a millisecond and a tenth of one, on every request's path (decode
takes the client's prompt, prefill the job's)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt


def token_array(ids: Iterable[int]) -> npt.NDArray[np.int64]:
    """The ids as int64 (a repeated uint32 field: one copy, no Python objects)."""
    return np.asarray(ids, dtype=np.int64)


def token_list(ids: Iterable[int]) -> list[int]:
    """The ids as a list of Python ints."""
    listed: list[int] = token_array(ids).tolist()
    return listed
