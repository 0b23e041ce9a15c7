"""Disaggregated tokens == colocated tokens, bit for bit, for every tiny preset and TP pair
(including two SSM groups replicated across ranks at TP 4 and 8).

Each (family, prefill TP, decode TP) runs a real prefill and decode service in this process
(grpc.aio on port 0, NIXL READs over UCX on DRAM) with the reference engine and sends prompts of
lengths 1, 2, 3, bs-1, bs, bs+1 and 2bs+5 (bs: the prefill block size) concurrently, each decoding
past a decode block boundary; the tokens must equal a colocated run of the same model, and the
decode service checks that the state it read equals the state prefill computed. Negative controls
corrupt the state the decode engine reads after the transfer and must change the tokens.

The paged engine (the batched one) runs the same check on a tiny nemotron_h checkpoint at both
boundaries, at one TP pair each whose block sizes differ (32 tokens at TP 1 and 2, 16 at TP 4),
against the paged colocated runner; its negative control zeroes the SSM state decode received.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from functools import cache
from typing import Any

import grpc
import pytest

from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.engine.paged.engine import PagedEngine
from shared.engine.paged_state import PagedStateStore
from shared.engine.protocol import DecodeSession, EnsureCapacity, RequestBlocks
from shared.engine.reference.colocated import colocated_generate
from shared.engine.reference.negative_controls import NEGATIVE_CONTROLS, Corruption
from shared.engine.reference_engine import ReferenceEngine
from shared.engine.sampling import GREEDY, SamplingParams
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.plan import ByteRead, TransferPlan, build_plan
from shared.layout.presets import TINY_PRESETS
from shared.rpc import compat
from tests.integration.exactness.pair import service_pair
from tests.integration.exactness.subjects import Subject, subject_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TP_PAIRS = list(itertools.product((1, 2, 4), repeat=2))
TEXT = bytes(range(32, 127)) * 3


def prompt_of(length: int) -> list[int]:
    return list(TEXT[:length])


@cache
def expected(model: str, length: int, max_tokens: int) -> tuple[int, ...]:
    return tuple(colocated_generate(TINY_PRESETS[model], prompt_of(length), max_tokens))


def matrix_lengths(subject: Subject, prefill_tp: int) -> list[int]:
    bs = build_engine_layout(subject.spec, prefill_tp).block_size
    return [1, 2, 3, bs - 1, bs, bs + 1, 2 * bs + 5]


@pytest.mark.asyncio
@pytest.mark.parametrize("prefill_tp,decode_tp", TP_PAIRS, ids=[f"P{p}-D{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("model", sorted(TINY_PRESETS))
async def test_disaggregated_tokens_equal_colocated(model: str, prefill_tp: int, decode_tp: int) -> None:
    await assert_tokens_equal_colocated(Subject("reference", model), prefill_tp, decode_tp)


PAGED_CASES = [(Subject("paged", "nemotron_h"), 2, 4), (Subject("paged", "nemotron_h", at_boundary="n-1"), 4, 1)]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "subject,prefill_tp,decode_tp", PAGED_CASES, ids=[f"{s.engine}-{s.name}-{s.boundary}-P{p}-D{d}" for s, p, d in PAGED_CASES]
)
async def test_paged_disaggregated_tokens_equal_colocated(subject: Subject, prefill_tp: int, decode_tp: int) -> None:
    await assert_tokens_equal_colocated(subject, prefill_tp, decode_tp)


# Two SSM groups at TP 8: each group's B/C on 4 decode (or prefill) ranks; the matrix above
# covers TP 4, where each group is on 2 ranks.
GROUP_PAIRS = [(4, 8), (8, 2)]


@pytest.mark.asyncio
@pytest.mark.parametrize("prefill_tp,decode_tp", GROUP_PAIRS, ids=[f"P{p}-D{d}" for p, d in GROUP_PAIRS])
async def test_groups_replicated_at_tp8_equal_colocated(prefill_tp: int, decode_tp: int) -> None:
    await assert_tokens_equal_colocated(Subject("reference", "tiny-mamba2-g2"), prefill_tp, decode_tp)


async def assert_tokens_equal_colocated(subject: Subject, prefill_tp: int, decode_tp: int) -> None:
    max_tokens = build_engine_layout(subject.spec, decode_tp).block_size + 2
    lengths = matrix_lengths(subject, prefill_tp)
    async with subject_pair(subject, prefill_tp, decode_tp, extra_decode=["--check-state"]) as pair:
        results = await asyncio.gather(*(pair.generate(prompt_of(n), max_tokens) for n in lengths))
    for n, got in zip(lengths, results):
        assert got.summary.state_verified, f"prompt of {n}: decode did not verify the transferred state"
        assert got.summary.num_transferred_tokens == subject.computed(n)
        assert got.token_ids == await subject.expected(prompt_of(n), max_tokens), f"prompt of {n} tokens"


class CorruptingEngine(ReferenceEngine):
    """Test-only decode engine: corrupts the state it received before decoding, as a broken
    transfer would (the disaggregated path is otherwise the real one)."""

    def __init__(self, layout: EngineLayout, ranks: Sequence[RankViews], corruption: Corruption) -> None:
        super().__init__(layout, ranks)
        self.corruption = corruption

    def start_decode(
        self,
        prompt: Sequence[int],
        num_computed: int,
        blocks: RequestBlocks,
        ensure_capacity: EnsureCapacity,
        *,
        sampling: SamplingParams = GREEDY,
        first_token: int | None = None,
    ) -> DecodeSession:
        store = PagedStateStore(self.layout, self.ranks, blocks)
        self.corruption(self.model, store, prompt)
        return super().start_decode(prompt, num_computed, blocks, ensure_capacity, sampling=sampling)


@pytest.mark.asyncio
@pytest.mark.parametrize("control", ["zero_ssm_state", "swap_conv_sections", "shift_conv_window", "replay_last_prompt_token"])
async def test_negative_controls_change_disaggregated_tokens(control: str) -> None:
    model, length, max_tokens = "tiny-mamba2-g1", 20, 12

    def factory(layout: EngineLayout, caches: Sequence[RankCache]) -> CorruptingEngine:
        return CorruptingEngine(layout, [RankViews(layout, c) for c in caches], NEGATIVE_CONTROLS[control])

    async with service_pair(model, 2, 4, decode_factory=factory) as pair:
        got = await pair.generate(prompt_of(length), max_tokens)
    assert tuple(got.token_ids) != expected(model, length, max_tokens), f"{control} did not change the tokens"


@pytest.mark.asyncio
async def test_paged_zeroed_ssm_state_changes_disaggregated_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The paged negative control: decode's engine starts from a zeroed SSM state instead of the
    one it READ (TEST-ONLY, as a broken transfer would); the tokens must change."""
    subject, length, max_tokens = PAGED_CASES[0][0], 20, 12
    start_decode = PagedEngine.start_decode

    def zeroing(self: PagedEngine, prompt: Sequence[int], num_computed: int, blocks: RequestBlocks, *a: Any, **kw: Any) -> Any:
        PagedStateStore(self.layout, self.ranks, blocks).reset_ssm()
        return start_decode(self, prompt, num_computed, blocks, *a, **kw)

    want = await subject.expected(prompt_of(length), max_tokens)
    async with subject_pair(subject, 2, 4) as pair:
        healthy = await pair.generate(prompt_of(length), max_tokens)
        monkeypatch.setattr(PagedEngine, "start_decode", zeroing)
        zeroed = await pair.generate(prompt_of(length), max_tokens)
    assert healthy.token_ids == want
    assert zeroed.token_ids != want, "a zeroed SSM state did not change the tokens"


def other_group_plan(plan: TransferPlan) -> TransferPlan:
    """Test-only wrong plan for tiny-mamba2-g2 from prefill TP 1 (whose B and C each hold both
    groups): every decode rank reads the other group's B/C rows. No real plan reads this way,
    so it is injected where the services build their plan."""
    ps, n = plan.prefill.shapes, plan.decode.shapes.section_bytes[1]  # one group of B (or C)

    def other(c: ByteRead | None, s: int) -> ByteRead | None:
        if c is None or s == 0:
            return c
        start = ps.section_offsets[s]
        return dataclasses.replace(c, remote_offset=start + n - (c.remote_offset - start))

    ranks = [
        dataclasses.replace(
            rank,
            reads=tuple(
                dataclasses.replace(read, conv=tuple(other(c, s) for s, c in enumerate(read.conv))) for read in rank.reads
            ),
        )
        for rank in plan.ranks
    ]
    return dataclasses.replace(plan, ranks=tuple(ranks))


@pytest.mark.asyncio
async def test_a_plan_reading_the_wrong_group_changes_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control with real READs: the same request as the matrix's P1-D4 case, but the
    plan reads the other group's B/C. Without digests the tokens change and decode's state check
    refuses it; with digests (the default) the request fails before decoding: the digests follow
    the layout's index functions, not the plan, so they catch a wrong plan too."""
    model, length, max_tokens = "tiny-mamba2-g2", 20, 12
    monkeypatch.setattr(compat, "build_plan", lambda p, d: other_group_plan(build_plan(p, d)))
    off = ["--verify-transfer", "off"]
    async with service_pair(model, 1, 4, extra_prefill=off, extra_decode=off) as pair:
        got = await pair.generate(prompt_of(length), max_tokens)
    assert tuple(got.token_ids) != expected(model, length, max_tokens), "the wrong group did not change the tokens"
    async with service_pair(model, 1, 4, extra_prefill=off, extra_decode=[*off, "--check-state"]) as pair:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(prompt_of(length), max_tokens)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "conv state differs" in str(err.value.details())
    async with service_pair(model, 1, 4) as pair:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(prompt_of(length), max_tokens)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "conv of layer group" in str(err.value.details())


@pytest.mark.asyncio
async def test_wrong_group_changes_disaggregated_tokens() -> None:
    """Negative control where every prefill rank holds one group (P2-D4): decode holding the
    other group's B/C (as reading the wrong source would) must change the tokens; the clean
    run is in the matrix."""
    prefill_tp, decode_tp = 2, 4
    model, length, max_tokens = "tiny-mamba2-g2", 20, 12

    def factory(layout: EngineLayout, caches: Sequence[RankCache]) -> CorruptingEngine:
        return CorruptingEngine(layout, [RankViews(layout, c) for c in caches], NEGATIVE_CONTROLS["swap_groups"])

    async with service_pair(model, prefill_tp, decode_tp, decode_factory=factory) as pair:
        got = await pair.generate(prompt_of(length), max_tokens)
    assert tuple(got.token_ids) != expected(model, length, max_tokens), "swapped groups did not change the tokens"
