"""Decode's prefix reuse with DEFAULT flags (no --prefix-cache-blocks / --prefix-cache-states):
on for the reference engine, sized from the cache (a quarter of its blocks; checkpoints sized
from those). A second turn that extends the first moves fewer bytes than the same prompt sent
cold, and its tokens equal the colocated run's; `--prefix-cache-blocks 0` turns it off. On the
reference engine (tiny-mamba2) and the paged engine (nemotron_h, its prefill in chunks of 16,
without which no prefix of its K/V is stable: `subjects.PAGED`)."""

from __future__ import annotations

import pytest

from decode_svc.app import DecodeApp
from tests.integration.exactness.multi_turn import ANSWER, random_tokens
from tests.integration.exactness.pair import Generated, service_pair
from tests.integration.exactness.subjects import PAGED, REFERENCE, Subject, subject_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

MODEL = REFERENCE.name
SUBJECTS = [REFERENCE, PAGED]
NUM_BLOCKS = 96


def moved(got: Generated) -> int:
    t = got.summary.transfer
    return t.attention_bytes + t.conv_bytes + t.ssm_bytes


def reuse_of(decode: DecodeApp) -> tuple[int, int]:
    reuse = decode.servicer.generation.reuse
    return reuse.prefix.capacity_blocks, reuse.states.capacity


@pytest.mark.parametrize("subject", SUBJECTS, ids=[s.id for s in SUBJECTS])
async def test_a_second_turn_moves_less_than_cold_with_default_flags(subject: Subject) -> None:
    first = random_tokens(7, 70)
    async with subject_pair(subject, 1, 2, num_blocks=NUM_BLOCKS, default_reuse=True) as pair:
        groups = len(pair.decode.host.layout.groups)
        assert reuse_of(pair.decode) == (NUM_BLOCKS // 4, NUM_BLOCKS // 4 // groups)
        turn1 = await pair.generate(first, ANSWER, request_id="default-t1")
        second = [*first, *turn1.token_ids, *random_tokens(8, 40)]
        warm = await pair.generate(second, ANSWER, request_id="default-t2")
    async with subject_pair(subject, 1, 2, num_blocks=NUM_BLOCKS, default_reuse=True) as fresh:
        cold = await fresh.generate(second, ANSWER, request_id="default-cold")
    expected = await subject.expected(second, ANSWER)
    assert warm.token_ids == cold.token_ids == expected
    assert turn1.token_ids == await subject.expected(first, ANSWER)
    assert warm.summary.prefix_cached_tokens > 0 and cold.summary.prefix_cached_tokens == 0
    assert warm.summary.digests_verified and cold.summary.digests_verified
    assert moved(warm) < moved(cold)
    assert warm.summary.transfer.attention_bytes < cold.summary.transfer.attention_bytes
    # What the prefix cache held is the K/V that stayed: the SSM / conv state still moves whole.
    assert (warm.summary.transfer.ssm_bytes, warm.summary.transfer.conv_bytes) == (
        cold.summary.transfer.ssm_bytes,
        cold.summary.transfer.conv_bytes,
    )


async def test_zero_turns_reuse_off_and_the_synthetic_engine_keeps_nothing() -> None:
    async with service_pair(
        MODEL, 1, 1, num_blocks=NUM_BLOCKS, default_reuse=True, extra_decode=["--prefix-cache-blocks", "0"]
    ) as off:
        assert reuse_of(off.decode) == (0, 0)
    async with service_pair(MODEL, 1, 1, engine="synthetic", num_blocks=NUM_BLOCKS, default_reuse=True) as synthetic:
        assert reuse_of(synthetic.decode) == (0, 0)  # its K/V patterns are seeded by the whole prompt
