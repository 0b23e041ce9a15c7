"""Decode's check that a request's manifest parts cover its state once, in order, before the
last READ: token parts, and layer parts of the last chunk covering the model's layers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from decode_svc.part_reads import PartReads
from shared.cache.manifest import Manifest, ManifestPart
from shared.errors import ServiceError

LAYERS = 6


def part(index: int, count: int, tokens: tuple[int, int], layers: range | None = None, skipped: int = 0) -> Manifest:
    return Manifest(
        request_id="r",
        transfer_id="t",
        block_ids=(np.arange(3, dtype=np.int64),),
        num_computed_tokens=48,
        prompt_token_count=49,
        lease_ns=1,
        lease_expire_time_ns=1,
        prefill_ns=1,
        skipped_tokens=skipped,
        part=ManifestPart(index, count, *tokens, layers),
    )


def chain_ok(*manifests: Manifest) -> bool:
    reads = PartReads()
    reads.parts = list(manifests[:-1])
    try:
        reads.check_chain(manifests[-1], "p0", LAYERS)
    except ServiceError as e:
        assert (e.status, e.reason, e.issues[0].field) == ("INTERNAL", "BAD_MANIFEST", "manifest.part")
        return False
    return True


def test_token_parts_and_layer_parts_that_cover_everything_once_in_order_pass() -> None:
    assert chain_ok(part(0, 2, (0, 32)), part(1, 2, (32, 48)))
    assert chain_ok(
        part(0, 4, (0, 32)),
        part(1, 4, (32, 48), range(0, 2)),
        part(2, 4, (32, 48), range(2, 5)),
        part(3, 4, (32, 48), range(5, 6)),
    )
    assert chain_ok(part(0, 2, (32, 48), range(0, 3), skipped=32), part(1, 2, (32, 48), range(3, 6), skipped=32))


@pytest.mark.parametrize(
    "layer_ranges",
    [
        (range(0, 2), range(3, 6)),  # a gap
        (range(0, 3), range(2, 6)),  # an overlap
        (range(1, 3), range(3, 6)),  # not from layer 0
        (range(0, 3), range(3, 5)),  # the last layer missing
        (range(3, 6), range(0, 3)),  # out of order
    ],
)
def test_layer_parts_that_miss_repeat_or_reorder_layers_are_refused(layer_ranges: tuple[range, ...]) -> None:
    count = 1 + len(layer_ranges)
    layer_parts = [part(1 + i, count, (32, 48), r) for i, r in enumerate(layer_ranges)]
    assert not chain_ok(part(0, count, (0, 32)), *layer_parts)


def test_a_token_part_inside_layer_parts_or_a_repeated_token_range_is_refused() -> None:
    assert not chain_ok(part(0, 3, (32, 48), range(0, 3)), part(1, 3, (0, 32)), part(2, 3, (32, 48), range(3, 6)))
    assert not chain_ok(part(0, 3, (0, 32)), part(1, 3, (0, 32)), part(2, 3, (32, 48)))
    last = part(2, 3, (32, 48), range(3, 6))
    assert not chain_ok(part(0, 3, (0, 32)), part(1, 3, (16, 48), range(0, 3)), last)  # not the last part's tokens
    assert not chain_ok(part(0, 3, (0, 32)), dataclasses.replace(part(1, 3, (32, 48)), part=None), last)
