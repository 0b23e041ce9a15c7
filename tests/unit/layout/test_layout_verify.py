"""The verifier and the byte-level simulator: every plan we build passes both; wrong plans
(vLLM's proportional B/C offsets with n_groups = 1 or with groups replicated across ranks,
the wrong group's replica, shifted offsets, missing or doubled reads) fail both."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shared.layout.page import build_engine_layout
from shared.layout.plan import ByteRead, RankPlan, TransferPlan, build_plan
from shared.layout.plan_json import SCHEMA, plan_to_json
from shared.layout.presets import PRESETS, get_preset
from shared.layout.shapes import valid_tp
from shared.layout.spec import DTYPES, GDNDims, LayerKind, Mamba1Dims, Mamba2Dims, ModelSpec
from shared.layout.verify import simulate_transfer, verify_plan

pytestmark = pytest.mark.timeout(180)
LAYOUT_SETTINGS = settings(deadline=None, max_examples=40)
TPS = (1, 2, 4, 8)
TPS_16 = (1, 2, 4, 8, 16)


def plan_for(spec: ModelSpec, p: int, d: int, **kw: int) -> TransferPlan:
    return build_plan(build_engine_layout(spec, p, **kw), build_engine_layout(spec, d, **kw))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_pair_verifies(name: str) -> None:
    spec = PRESETS[name]
    for p, d in itertools.product(TPS_16, TPS_16):
        if valid_tp(spec, p) and valid_tp(spec, d):
            assert verify_plan(plan_for(spec, p, d)) == [], (p, d)
            assert verify_plan(plan_for(spec, p, d, kernel_block_size=16)) == [], (p, d)


# --- wrong plans ----------------------------------------------------------------------------------


def proportional_bc_plan(plan: TransferPlan) -> TransferPlan:
    """The plan with vLLM's (v0.20 / #45019) proportional conv offsets, which assume every
    section shrinks with TP: wrong for Mamba2 with n_groups = 1 (replicated B/C)."""
    s = plan.decode.shapes
    z, o = s.section_bytes, s.section_offsets
    ranks = []
    for rank in plan.ranks:
        d, ratio = rank.decode_rank, plan.tp_ratio
        reads = []
        for idx, read in enumerate(rank.reads):
            if ratio > 0:
                ell = d % ratio
                conv = tuple(ByteRead(ratio * o[i] + ell * z[i], o[i], z[i]) for i in range(len(z)))
            else:
                a = -ratio
                zr = [x // a for x in z]
                conv = tuple(ByteRead(sum(zr[:i]), o[i] + idx * zr[i], zr[i]) for i in range(len(z)))
            reads.append(dataclasses.replace(read, conv=conv))
        ranks.append(dataclasses.replace(rank, reads=tuple(reads)))
    return dataclasses.replace(plan, ranks=tuple(ranks))


@pytest.mark.parametrize("name", ["tiny-mamba2-g1", "granite-4.0-h-tiny", "falcon-h1-1.5b"])
@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 4), (1, 4), (2, 1), (4, 2), (4, 1)])
def test_proportional_bc_offsets_with_one_group_are_caught(name: str, p: int, d: int) -> None:
    plan = plan_for(PRESETS[name], p, d)
    bad = proportional_bc_plan(plan)
    violations = verify_plan(bad)
    assert violations, "the verifier missed vLLM's proportional B/C offsets"
    assert any("conv section" in v for v in violations)
    assert verify_plan(plan) == []


@pytest.mark.parametrize(("p", "d"), [(2, 4), (4, 2), (1, 2)])
def test_simulator_catches_proportional_bc_offsets(p: int, d: int) -> None:
    plan = plan_for(get_preset("tiny-mamba2-g1"), p, d)
    assert simulate_transfer(plan, num_tokens=20) == []
    mismatches = simulate_transfer(proportional_bc_plan(plan), num_tokens=20)
    assert any("conv state differs" in m for m in mismatches)


GROUP_CASES = [
    ("tiny-mamba2-g2", 2, 4),
    ("tiny-mamba2-g2", 1, 4),
    ("tiny-mamba2-g2", 4, 2),
    ("tiny-mamba2-g2", 8, 4),
    ("tiny-mamba2-g2", 2, 8),
    ("nemotron-3-nano-30b-a3b", 8, 16),
    ("nemotron-3-nano-30b-a3b", 16, 8),
    ("nemotron-3-nano-30b-a3b", 4, 16),
    ("nemotron-h-8b", 16, 2),
]


@pytest.mark.parametrize(("name", "p", "d"), GROUP_CASES)
def test_proportional_bc_offsets_with_replicated_groups_are_caught(name: str, p: int, d: int) -> None:
    plan = plan_for(PRESETS[name], p, d)
    assert verify_plan(plan) == []
    violations = verify_plan(proportional_bc_plan(plan))
    assert any("conv section" in v for v in violations), "the verifier missed proportional B/C offsets"


def other_group_plan(plan: TransferPlan) -> TransferPlan:
    """Every B/C read moved by one group (d_state rows) inside the source's section, wrapping
    around: the neighbouring group instead of the one the decode rank's heads use. It changes
    the plan only where a source holds more than one group (prefill TP < n_groups)."""
    ssm = plan.decode.spec.ssm
    assert isinstance(ssm, Mamba2Dims)
    ps, ds = plan.prefill.shapes, plan.decode.shapes
    group = ssm.d_state * ds.conv_row_bytes
    ranks = []
    for rank in plan.ranks:
        reads = []
        for read in rank.reads:
            conv = list(read.conv)
            for s in (1, 2):
                c = conv[s]
                if c is not None:
                    lo, size = ps.section_offsets[s], ps.section_bytes[s]
                    moved = lo + (c.remote_offset - lo + group) % size
                    if moved + c.size > lo + size:
                        moved = lo  # keep it inside the section: a wrong group, not an overrun
                    conv[s] = dataclasses.replace(c, remote_offset=moved)
            reads.append(dataclasses.replace(read, conv=tuple(conv)))
        ranks.append(dataclasses.replace(rank, reads=tuple(reads)))
    return dataclasses.replace(plan, ranks=tuple(ranks))


@pytest.mark.parametrize(
    ("name", "p", "d"),
    [("tiny-mamba2-g2", 1, 4), ("tiny-mamba2-g2", 1, 8), ("nemotron-3-nano-30b-a3b", 4, 16), ("nemotron-h-8b", 2, 16)],
)
def test_the_wrong_group_is_caught(name: str, p: int, d: int) -> None:
    plan = plan_for(PRESETS[name], p, d)
    bad = other_group_plan(plan)
    assert bad != plan
    assert any("conv section" in v and "reads elements" in v for v in verify_plan(bad))


@pytest.mark.parametrize(("p", "d"), [(2, 4), (4, 2), (1, 4), (8, 2), (2, 8)])
def test_simulator_with_replicated_groups(p: int, d: int) -> None:
    plan = plan_for(get_preset("tiny-mamba2-g2"), p, d)
    assert simulate_transfer(plan, num_tokens=20) == []
    assert any("conv state differs" in m for m in simulate_transfer(proportional_bc_plan(plan), num_tokens=20))
    if p < 2:  # a source holding both groups: the wrong one can be read
        assert any("conv state differs" in m for m in simulate_transfer(other_group_plan(plan), num_tokens=20))


def test_proportional_offsets_are_right_when_groups_shard() -> None:
    """Negative control for the test above: with n_groups % TP == 0 the same rule is correct."""
    for p, d in ((1, 2), (2, 4), (4, 2), (8, 1)):
        plan = plan_for(get_preset("tiny-mamba2"), p, d)
        assert verify_plan(proportional_bc_plan(plan)) == []


def mutate(plan: TransferPlan, d: int, fn: object) -> TransferPlan:
    rank = plan.ranks[d]
    new_rank: RankPlan = fn(rank)  # type: ignore[operator]
    ranks = list(plan.ranks)
    ranks[d] = new_rank
    return dataclasses.replace(plan, ranks=tuple(ranks))


def first_read(rank: RankPlan, **changes: object) -> RankPlan:
    return dataclasses.replace(rank, reads=(dataclasses.replace(rank.reads[0], **changes), *rank.reads[1:]))


@pytest.mark.parametrize(
    ("label", "change", "message"),
    [
        (
            "ssm shifted one row",
            lambda r: first_read(r, ssm=dataclasses.replace(r.reads[0].ssm, remote_offset=r.reads[0].ssm.remote_offset + 960)),
            "SSM",
        ),
        ("x missing", lambda r: first_read(r, conv=(None, *r.reads[0].conv[1:])), "never written"),
        (
            "B and C swapped",
            lambda r: first_read(r, conv=(r.reads[0].conv[0], r.reads[0].conv[2], r.reads[0].conv[1])),
            "conv section",
        ),
        (
            "read twice",
            lambda r: dataclasses.replace(
                r, reads=(*r.reads, dataclasses.replace(r.reads[-1], prefill_rank=r.reads[-1].prefill_rank))
            ),
            "allowed once",
        ),
        (
            "FA from the wrong head",
            lambda r: first_read(r, fa=dataclasses.replace(r.reads[0].fa, remote_offset=r.reads[0].fa.remote_offset + 1024)),
            "FA",
        ),
        ("FA missing", lambda r: first_read(r, fa=None), "FA K/V half"),
        (
            "source not a candidate",
            lambda r: dataclasses.replace(r, reads=(dataclasses.replace(r.reads[0], prefill_rank=3),)),
            "allowed",
        ),
    ],
)
def test_verifier_catches_wrong_plans(label: str, change: object, message: str) -> None:
    plan = plan_for(get_preset("tiny-mamba2"), 2, 4)  # decode rank 1 reads from prefill rank 0
    bad = mutate(plan, 1, change)
    violations = verify_plan(bad)
    assert any(message in v for v in violations), (label, violations)


def test_simulator_catches_a_shifted_ssm_offset() -> None:
    plan = plan_for(get_preset("tiny-gdn"), 2, 2)
    shift = plan.decode.shapes.ssm_row_bytes
    bad = mutate(
        plan,
        0,
        lambda r: first_read(r, ssm=dataclasses.replace(r.reads[0].ssm, remote_offset=r.reads[0].ssm.remote_offset + shift)),
    )
    assert any("SSM state differs" in m for m in simulate_transfer(bad, num_tokens=5))


# --- the simulator round-trips every plan we build --------------------------------------------


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    base = get_preset("tiny-mamba2")
    letters = draw(st.lists(st.sampled_from("SAPM"), min_size=2, max_size=7))
    if not any(c in "AP" for c in letters):
        letters.append("A")
    if not any(c in "SP" for c in letters):
        letters.insert(0, "S")
    table: dict[str, LayerKind] = {"S": "ssm", "A": "attention", "P": "parallel", "M": "mlp"}
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    att = dataclasses.replace(base.attention, num_heads=8, num_kv_heads=kv, head_dim=draw(st.sampled_from([2, 3])))
    ssm: Mamba2Dims | GDNDims | Mamba1Dims = draw(
        st.one_of(
            st.builds(
                Mamba2Dims, st.sampled_from([8, 16]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 8]), st.sampled_from([2, 3])
            ),
            st.builds(GDNDims, st.just(8), st.sampled_from([8, 16]), st.sampled_from([2, 3]), st.sampled_from([1, 2])),
            st.builds(Mamba1Dims, st.sampled_from([8, 16]), st.sampled_from([2, 3]), st.just(2)),
        )
    )
    return dataclasses.replace(
        base,
        name="random",
        layer_kinds=tuple(table[c] for c in letters),
        attention=att,
        ssm=ssm,
        kv_dtype=draw(st.sampled_from(DTYPES)),
        conv_dtype=draw(st.sampled_from(DTYPES)),
        ssm_dtype=draw(st.sampled_from(DTYPES)),
        num_spec_tokens=draw(st.sampled_from([0, 0, 1])),
    )


@LAYOUT_SETTINGS
@given(
    spec=specs(),
    p=st.sampled_from(TPS),
    d=st.sampled_from(TPS),
    alignment=st.sampled_from([1, 2, 16]),
    kernels=st.tuples(st.sampled_from([None, 1, 2, 4]), st.sampled_from([None, 1, 2, 4])),
    tokens=st.integers(0, 40),
    contiguous=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_simulated_transfer_round_trips(
    spec: ModelSpec,
    p: int,
    d: int,
    alignment: int,
    kernels: tuple[int | None, int | None],
    tokens: int,
    contiguous: bool,
    seed: int,
) -> None:
    assume(valid_tp(spec, p) and valid_tp(spec, d))
    prefill = build_engine_layout(spec, p, alignment=alignment, kernel_block_size=kernels[0])
    decode = build_engine_layout(spec, d, alignment=alignment, kernel_block_size=kernels[1])
    plan = build_plan(prefill, decode)
    assert verify_plan(plan) == []
    assert simulate_transfer(plan, num_tokens=tokens, seed=seed, contiguous=contiguous) == []


@pytest.mark.parametrize(
    ("name", "p", "d", "kernels"),
    [
        ("qwen3.5-0.8b", 2, 4, (16, 16)),
        ("qwen3.5-0.8b", 4, 1, (None, 32)),
        ("jamba-reasoning-3b", 4, 1, (16, None)),
        ("granite-4.0-h-tiny", 1, 4, (None, None)),
        ("nemotron-3-nano-30b-a3b", 8, 16, (None, None)),
        ("nemotron-3-nano-30b-a3b", 16, 4, (16, None)),
    ],
)
def test_simulated_transfer_real_models(name: str, p: int, d: int, kernels: tuple[int | None, int | None]) -> None:
    spec = PRESETS[name]
    plan = build_plan(
        build_engine_layout(spec, p, kernel_block_size=kernels[0]), build_engine_layout(spec, d, kernel_block_size=kernels[1])
    )
    assert simulate_transfer(plan, num_tokens=33, spare_blocks=1) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_simulated_transfer_every_preset_pair_up_to_tp16(name: str) -> None:
    """The long sweep behind `plan --all`: real bytes through every valid pair in {1..16}^2."""
    spec = PRESETS[name]
    for p, d in itertools.product(TPS_16, TPS_16):
        if valid_tp(spec, p) and valid_tp(spec, d):
            assert simulate_transfer(plan_for(spec, p, d), num_tokens=33, spare_blocks=1) == [], (p, d)


# --- JSON --------------------------------------------------------------------------------------


def test_plan_json_schema() -> None:
    plan = plan_for(get_preset("tiny-mamba2-g1"), 4, 2)
    doc = plan_to_json(plan)
    assert list(doc) == ["schema", "model", "family", "tp_ratio", "prefill", "decode", "ranks", "verified", "violations"]
    assert (doc["schema"], doc["model"], doc["family"], doc["tp_ratio"], doc["verified"]) == (
        SCHEMA,
        "tiny-mamba2-g1",
        "mamba2",
        -2,
        True,
    )
    assert set(doc["prefill"]) == {
        "tp",
        "kv_heads_per_rank",
        "block_size",
        "kernel_block_size",
        "physical_per_logical",
        "page_bytes",
        "fa_bytes_per_token",
        "conv_bytes",
        "ssm_bytes",
        "section_dims",
        "section_bytes",
        "num_regions",
    }
    assert doc["decode"]["section_dims"] == [48, 10, 10]
    rank = doc["ranks"][0]
    assert (rank["decode_rank"], rank["fa_sources"], rank["mamba_sources"]) == (0, [0], [0, 1])
    second = rank["reads"][1]
    assert second["fa"] is None and second["conv"][1:] == [None, None]
    assert second["conv"][0] == {"remote_offset": 0, "local_offset": 288, "bytes": 288}
    bad = plan_to_json(proportional_bc_plan(plan))
    assert bad["verified"] is False and bad["violations"]
