"""A request's token ids: taken from a message's repeated field as plain ints, equal to what
`list()` gives, and checked against the vocabulary the same way as a list or an array."""

from __future__ import annotations

import numpy as np
import pytest

from shared.engine.vocabulary import check_token_ids
from shared.errors import InvalidArgument
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc.token_ids import token_array, token_list

IDS = [0, 1, 255, 256, 70_000, 2**31, 2**32 - 1, 7]


def test_token_list_equals_list_of_the_repeated_field() -> None:
    message = pb.GenerateRequest.FromString(pb.GenerateRequest(prompt_token_ids=IDS).SerializeToString())
    got = token_list(message.prompt_token_ids)
    assert got == list(message.prompt_token_ids) == IDS
    assert all(type(t) is int for t in got)  # plain ints: engines and JSON take them as they are
    assert token_array(message.prompt_token_ids).dtype == np.int64
    assert token_list(pb.GenerateRequest().prompt_token_ids) == []


@pytest.mark.parametrize("form", [list, np.asarray], ids=["list", "array"])
def test_an_id_outside_the_vocabulary_is_named_with_its_position(form: type) -> None:
    check_token_ids(form([0, 255, 3]), 256, "prompt_token_ids")  # inside: no error
    check_token_ids(form([]), 256, "prompt_token_ids")
    with pytest.raises(InvalidArgument) as raised:
        check_token_ids(form([3, 256, 9, 300]), 256, "prompt_token_ids")
    assert raised.value.fields == ("prompt_token_ids",)
    assert "token id 256 at position 1 is outside the vocabulary [0, 256)" in raised.value.message
