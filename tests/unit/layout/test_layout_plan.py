"""Transfer plans: vLLM's sign convention, source ranks, and vLLM's closed-form offsets
(layout-spec sections 4.2-4.4) wherever those are right; the replicated-B/C fix where they are not."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shared.layout.compat import layout_issues
from shared.layout.page import build_engine_layout
from shared.layout.plan import ByteRead, TransferPlan, build_plan, candidate_ranks, tp_ratio
from shared.layout.presets import PRESETS, get_preset
from shared.layout.shapes import valid_tp
from shared.layout.spec import LayoutError, Mamba2Dims, ModelSpec

pytestmark = pytest.mark.timeout(120)
LAYOUT_SETTINGS = settings(deadline=None, max_examples=40)
TPS = (1, 2, 4, 8)


def plan_for(spec: ModelSpec, p: int, d: int, **kw: int) -> TransferPlan:
    return build_plan(build_engine_layout(spec, p, **kw), build_engine_layout(spec, d, **kw))


def valid_pairs(spec: ModelSpec) -> list[tuple[int, int]]:
    return [(p, d) for p, d in itertools.product(TPS, TPS) if valid_tp(spec, p) and valid_tp(spec, d)]


def test_tp_ratio_sign_convention() -> None:
    assert [tp_ratio(1, 1), tp_ratio(1, 4), tp_ratio(2, 4), tp_ratio(4, 2), tp_ratio(8, 1)] == [1, 4, 2, -2, -8]
    for p, d in ((2, 3), (4, 6), (0, 1)):
        with pytest.raises(LayoutError):
            tp_ratio(p, d)
    assert candidate_ranks(2, 4, 3) == (1,)
    assert candidate_ranks(8, 2, 1) == (4, 5, 6, 7)
    with pytest.raises(LayoutError, match="outside"):
        candidate_ranks(2, 4, 4)


# --- vLLM's closed forms (layout-spec 4.2 / 4.4), written out independently ------------------


def vllm_fa(plan: TransferPlan, d: int) -> dict[int, ByteRead]:
    """FA reads per source rank, with the relative head offset for replicated heads (4.2)."""
    P, D, K = plan.prefill.tp, plan.decode.tp, plan.decode.spec.attention.num_kv_heads
    s = plan.decode.shapes
    k_local = s.kv_heads_per_rank * plan.fa_unit_tokens * s.head_dim * s.kv_dtype_bytes
    ratio = plan.tp_ratio
    if ratio > 0:
        p = d // ratio
        factor = (d * K // D - p * K // P) if D > K else d % ratio
        return {p: ByteRead(factor * k_local, 0, k_local)}
    a = -ratio
    sources: list[int] = []
    seen: set[tuple[int, ...]] = set()
    for p in range(d * a, d * a + a):  # first rank of each distinct head set (GQA de-duplication)
        heads = tuple(range(p * K // P, (p + 1) * K // P)) if P <= K else (p * K // P,)
        if heads not in seen:
            seen.add(heads)
            sources.append(p)
    n = len(sources)
    return {p: ByteRead(0, i * k_local // n, k_local // n) for i, p in enumerate(sources)}


def vllm_mamba(plan: TransferPlan, d: int) -> dict[int, list[ByteRead]]:
    """Conv sections then SSM per source rank, proportional sections (4.4)."""
    s = plan.decode.shapes
    z, o = s.section_bytes, s.section_offsets
    ratio = plan.tp_ratio
    if ratio > 0:
        p, ell = d // ratio, d % ratio
        conv = [ByteRead(ratio * o[i] + ell * z[i], o[i], z[i]) for i in range(len(z))]
        return {p: [*conv, ByteRead(ratio * s.conv_bytes + ell * s.ssm_bytes, s.conv_bytes, s.ssm_bytes)]}
    a = -ratio
    zr = [x // a for x in z]
    starts = np.concatenate([[0], np.cumsum(zr)[:-1]]).tolist()
    out = {}
    for idx, p in enumerate(range(d * a, d * a + a)):
        conv = [ByteRead(starts[i], o[i] + idx * zr[i], zr[i]) for i in range(len(z))]
        ssm = ByteRead(sum(zr), s.conv_bytes + idx * s.ssm_bytes // a, s.ssm_bytes // a)
        out[p] = [*conv, ssm]
    return out


def ours(plan: TransferPlan, d: int) -> tuple[dict[int, ByteRead], dict[int, list[ByteRead]]]:
    rank = plan.ranks[d]
    fa = {r.prefill_rank: r.fa for r in rank.reads if r.fa is not None}
    mamba = {r.prefill_rank: list(r.mamba_reads) for r in rank.reads if r.mamba_reads}
    return fa, mamba


def proportional(spec: ModelSpec, p: int, d: int) -> bool:
    ssm = spec.ssm
    return not isinstance(ssm, Mamba2Dims) or (ssm.n_groups % p == 0 and ssm.n_groups % d == 0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_pair_matches_vllm_where_vllm_is_right(name: str) -> None:
    spec = PRESETS[name]
    for p, d in valid_pairs(spec):
        plan = plan_for(spec, p, d, kernel_block_size=16)
        for rank in range(d):
            fa, mamba = ours(plan, rank)
            assert fa == vllm_fa(plan, rank), (p, d, rank)
            if proportional(spec, p, d):
                assert mamba == vllm_mamba(plan, rank), (p, d, rank)


@st.composite
def mamba2_specs(draw: st.DrawFn) -> ModelSpec:
    base = get_preset("tiny-mamba2")
    heads = draw(st.sampled_from([8, 16]))
    ssm = Mamba2Dims(heads, draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([2, 5])))
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    att = dataclasses.replace(base.attention, num_kv_heads=kv, head_dim=draw(st.sampled_from([2, 4])))
    return dataclasses.replace(base, ssm=ssm, attention=att, kv_dtype=draw(st.sampled_from(["fp8", "bf16", "fp32"])))


@LAYOUT_SETTINGS
@given(spec=mamba2_specs(), p=st.sampled_from(TPS), d=st.sampled_from(TPS))
def test_random_mamba2_specs_match_vllm_closed_forms(spec: ModelSpec, p: int, d: int) -> None:
    assume(valid_tp(spec, p) and valid_tp(spec, d))
    plan = plan_for(spec, p, d)
    for rank in range(d):
        fa, mamba = ours(plan, rank)
        assert fa == vllm_fa(plan, rank)
        if proportional(spec, p, d):
            assert mamba == vllm_mamba(plan, rank)


# --- replicated B/C (n_groups == 1) --------------------------------------------------------------


def test_single_group_bc_read_whole_from_one_source_d_ge_p() -> None:
    """hybrid-models 1.6 worked check: I = 96, N = 10, P_TP 2 -> D_TP 4."""
    plan = plan_for(get_preset("tiny-mamba2-g1"), 2, 4)
    row = 3 * 4  # conv rows x fp32
    p_sec = plan.prefill.shapes.section_offsets  # x 48, B 10, C 10 rows
    for d in range(4):
        (read,) = plan.ranks[d].reads
        x, b, c = read.conv
        assert read.prefill_rank == d // 2
        assert x == ByteRead((d % 2) * 24 * row, 0, 24 * row)
        assert b == ByteRead(p_sec[1], 24 * row, 10 * row) and b.remote_offset == 48 * row
        assert c == ByteRead(p_sec[2], 34 * row, 10 * row) and c.remote_offset == 58 * row
    # vLLM's proportional rule would read P's C as rank 1's B and run past the conv state for C.
    wrong = vllm_mamba(plan, 1)[0]
    assert wrong[1].remote_offset == 58 * row and wrong[2].remote_offset + wrong[2].size > plan.prefill.shapes.conv_bytes


def test_single_group_bc_read_whole_from_one_source_p_gt_d() -> None:
    plan = plan_for(get_preset("tiny-mamba2-g1"), 4, 2)
    row = 12
    for d in range(2):
        rank = plan.ranks[d]
        assert rank.mamba_sources == (2 * d, 2 * d + 1)
        first, second = rank.reads
        assert first.conv[1] == ByteRead(24 * row, 48 * row, 10 * row)
        assert first.conv[2] == ByteRead(34 * row, 58 * row, 10 * row)
        assert second.conv[1] is None and second.conv[2] is None
        assert second.conv[0] == ByteRead(0, 24 * row, 24 * row)  # local split destination


# --- groups replicated across ranks (TP a multiple of n_groups > 1) ------------------------------


def groups_of(ssm: Mamba2Dims, tp: int, rank: int) -> list[int]:
    """The B/C groups a rank's heads use (head h uses group h·G/H), from the model math."""
    per = ssm.num_heads // tp
    return sorted({h * ssm.n_groups // ssm.num_heads for h in range(rank * per, (rank + 1) * per)})


def expected_mamba2(plan: TransferPlan, d: int) -> dict[int, list[ByteRead | None]]:
    """x, B, C, SSM reads per source rank written out for any TP pair: x and SSM rows shrink
    with TP (vLLM's 4.4 offsets inside x and SSM), B and C are whole groups, each read from the
    first candidate holding it, at that group's place inside both sides' sections."""
    ssm = plan.decode.spec.ssm
    assert isinstance(ssm, Mamba2Dims)
    ps, ds = plan.prefill.shapes, plan.decode.shapes
    row = ds.conv_row_bytes
    n = ssm.d_state * row  # one group of B (or C) in bytes
    mine = groups_of(ssm, plan.decode.tp, d)
    out: dict[int, list[ByteRead | None]] = {}
    ratio = plan.tp_ratio
    for idx, p in enumerate(candidate_ranks(plan.prefill.tp, plan.decode.tp, d)):
        if ratio > 0:
            ell = d % ratio
            x = ByteRead(ell * ds.section_bytes[0], 0, ds.section_bytes[0])
            state = ByteRead(ps.conv_bytes + ell * ds.ssm_bytes, ds.conv_bytes, ds.ssm_bytes)
        else:
            x = ByteRead(0, idx * ps.section_bytes[0], ps.section_bytes[0])
            state = ByteRead(ps.conv_bytes, ds.conv_bytes + idx * ps.ssm_bytes, ps.ssm_bytes)
        theirs = groups_of(ssm, plan.prefill.tp, p)
        before = candidate_ranks(plan.prefill.tp, plan.decode.tp, d)[:idx]
        earlier = {g for q in before for g in groups_of(ssm, plan.prefill.tp, q)}
        take = [g for g in mine if g in theirs and g not in earlier]
        bc: list[ByteRead | None] = [None, None]
        if take:
            for s in (1, 2):
                remote = ps.section_offsets[s] + (take[0] - theirs[0]) * n
                local = ds.section_offsets[s] + (take[0] - mine[0]) * n
                bc[s - 1] = ByteRead(remote, local, len(take) * n)
        out[p] = [x, *bc, state]
    return out


REPLICATED = [
    ("tiny-mamba2-g2", (1, 2, 4, 8)),
    ("tiny-mamba2-g1", (1, 2, 4, 8)),
    ("nemotron-3-nano-30b-a3b", (1, 2, 4, 8, 16)),
    ("nemotron-h-8b", (2, 4, 8, 16)),
]


@pytest.mark.parametrize(("name", "tps"), REPLICATED, ids=[n for n, _ in REPLICATED])
def test_replicated_groups_read_whole_from_one_source(name: str, tps: tuple[int, ...]) -> None:
    spec = get_preset(name)
    replicated = 0
    for p, d in itertools.product(tps, tps):
        plan = plan_for(spec, p, d, kernel_block_size=16)
        for rank in range(d):
            got = {r.prefill_rank: [*r.conv, r.ssm] for r in plan.ranks[rank].reads}
            assert got == expected_mamba2(plan, rank), (p, d, rank)
            fa, _ = ours(plan, rank)
            assert fa == vllm_fa(plan, rank)
        replicated += not proportional(spec, p, d)
    assert replicated > 0


def test_two_groups_p2_to_d4_and_back() -> None:
    """tiny-mamba2-g2 (I = 96, N = 10): decode TP 4 holds group d // 2 on ranks 2 apart."""
    row = 3 * 4
    plan = plan_for(get_preset("tiny-mamba2-g2"), 2, 4)
    for d in range(4):
        (read,) = plan.ranks[d].reads
        assert read.prefill_rank == d // 2  # holds exactly group d // 2: B at 48, C at 58 rows
        assert read.conv[1] == ByteRead(48 * row, 24 * row, 10 * row)
        assert read.conv[2] == ByteRead(58 * row, 34 * row, 10 * row)
    # vLLM's proportional rule puts odd decode ranks' B on the source's C.
    assert vllm_mamba(plan, 1)[0][1].remote_offset == 58 * row
    plan = plan_for(get_preset("tiny-mamba2-g2"), 4, 2)
    for d in range(2):
        first, second = plan.ranks[d].reads  # prefill ranks 2d and 2d + 1 both hold group d
        assert first.conv[1] == ByteRead(24 * row, 48 * row, 10 * row) and second.conv[1:] == (None, None)
    plan = plan_for(get_preset("tiny-mamba2-g2"), 1, 4)
    assert [plan.ranks[d].reads[0].conv[1].remote_offset for d in range(4)] == [r * row for r in (96, 96, 106, 106)]  # type: ignore[union-attr]


def test_sources_replicated_kv_heads() -> None:
    spec = get_preset("tiny-mamba2")  # 2 KV heads
    plan = plan_for(spec, 8, 2)
    assert [r.fa_sources for r in plan.ranks] == [(0,), (4,)]
    assert [r.mamba_sources for r in plan.ranks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    plan = plan_for(spec, 2, 4)  # the case where vLLM's absolute formula read out of bounds
    unit = plan.decode.fa_token_bytes * plan.fa_unit_tokens
    assert [plan.ranks[d].reads[0].fa for d in range(4)] == [ByteRead(0, 0, unit)] * 4
    plan = plan_for(spec, 1, 4)
    assert [plan.ranks[d].reads[0].fa.remote_offset for d in range(4)] == [0, 0, unit, unit]  # type: ignore[union-attr]


# --- block and kernel sizes --------------------------------------------------------------------


def test_fa_unit_is_the_gcd_of_kernel_block_sizes() -> None:
    spec = get_preset("tiny-gdn")
    plan = plan_for(spec, 1, 4)  # logical = kernel: 48 and 32
    assert (plan.prefill.kernel_block_size, plan.decode.kernel_block_size, plan.fa_unit_tokens) == (48, 32, 16)
    plan = build_plan(build_engine_layout(spec, 2, kernel_block_size=16), build_engine_layout(spec, 2, kernel_block_size=48))
    assert plan.fa_unit_tokens == 16
    nano = get_preset("nemotron-3-nano-30b-a3b")
    assert plan_for(nano, 2, 4).fa_unit_tokens == 16  # 2096 and 1056


# --- incompatible pairs ------------------------------------------------------------------------


def test_incompatible_layouts_name_every_difference() -> None:
    spec = get_preset("tiny-mamba2")
    base = build_engine_layout(spec, 2)
    other = build_engine_layout(spec.with_dtypes(kv="bf16", ssm="bf16"), 2)
    errors = [i.words for i in layout_issues(base, other)]
    assert any("KV dtype" in e for e in errors) and any("SSM dtype" in e for e in errors)
    with pytest.raises(LayoutError, match="KV dtype differs"):
        build_plan(base, other)
    with pytest.raises(LayoutError, match="model differs"):
        build_plan(base, build_engine_layout(get_preset("tiny-mamba2-g1"), 2))
    spec_rows = dataclasses.replace(spec, num_spec_tokens=1)
    with pytest.raises(LayoutError, match="conv rows"):
        build_plan(base, build_engine_layout(spec_rows, 2))
    assert layout_issues(base, build_engine_layout(spec, 4, kernel_block_size=8)) == []
