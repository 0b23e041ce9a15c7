"""Per-rank shapes (vLLM's documented values) and the sharding index functions.

The index functions are checked against a slow reference derived from what each rank's math
needs (its query heads need certain KV heads, its SSM heads need certain x channels and groups),
not from the section arithmetic the implementation uses.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shared.layout.presets import PRESETS, get_preset
from shared.layout.shapes import (
    check_tp,
    conv_channel_index,
    global_conv_dim,
    global_ssm_shape,
    kv_head_index,
    rank_shapes,
    ssm_row_index,
    valid_tp,
)
from shared.layout.spec import GDNDims, LayoutError, Mamba1Dims, Mamba2Dims, ModelSpec

pytestmark = pytest.mark.timeout(120)
LAYOUT_SETTINGS = settings(deadline=None, max_examples=40)


# --- vLLM's documented values (layout-spec section 5.4) --------------------------------------


@pytest.mark.parametrize(
    ("model", "tp", "conv", "ssm", "dims", "proj_bytes"),
    [
        ("nemotron-h-8b", 1, (10240, 3), (128, 64, 128), (8192, 1024, 1024), (49152, 6144, 6144)),
        ("nemotron-h-8b", 4, (2560, 3), (32, 64, 128), (2048, 256, 256), (12288, 1536, 1536)),
        ("nemotron-3-nano-30b-a3b", 1, (6144, 3), (64, 64, 128), (4096, 1024, 1024), (24576, 6144, 6144)),
        ("nemotron-3-nano-30b-a3b", 2, (3072, 3), (32, 64, 128), (2048, 512, 512), (12288, 3072, 3072)),
        ("nemotron-3-nano-30b-a3b", 4, (1536, 3), (16, 64, 128), (1024, 256, 256), (6144, 1536, 1536)),
        ("qwen3.5-0.8b", 1, (6144, 3), (16, 128, 128), (2048, 2048, 2048), None),
        ("qwen3.5-0.8b", 4, (1536, 3), (4, 128, 128), (512, 512, 512), None),
        ("jamba-mini-1.7", 1, (8192, 3), (8192, 16), (8192,), (49152,)),
        ("jamba-mini-1.7", 4, (2048, 3), (2048, 16), (2048,), (12288,)),
        ("jamba-mini-1.7", 8, (1024, 3), (1024, 16), (1024,), (6144,)),
    ],
)
def test_documented_state_shapes(
    model: str, tp: int, conv: tuple[int, int], ssm: tuple[int, ...], dims: tuple[int, ...], proj_bytes: tuple[int, ...] | None
) -> None:
    s = rank_shapes(get_preset(model), tp)
    assert (s.conv_dim, s.conv_rows) == conv
    assert s.ssm_shape == ssm
    assert s.section_dims == dims
    if proj_bytes is not None:
        assert s.section_bytes == proj_bytes


@pytest.mark.parametrize(
    ("hv", "tp", "conv", "ssm", "dims"),
    [
        (32, 1, 8192, (32, 128, 128), (2048, 2048, 4096)),
        (48, 1, 10240, (48, 128, 128), (2048, 2048, 6144)),
        (48, 8, 1280, (6, 128, 128), (256, 256, 768)),
    ],
)
def test_documented_qwen35_larger_gdn_shapes(hv: int, tp: int, conv: int, ssm: tuple[int, ...], dims: tuple[int, ...]) -> None:
    base = get_preset("qwen3.5-0.8b")
    att = dataclasses.replace(base.attention, num_heads=24, num_kv_heads=8)
    spec = dataclasses.replace(base, attention=att, ssm=GDNDims(num_k_heads=16, num_v_heads=hv, head_k_dim=128, head_v_dim=128))
    s = rank_shapes(spec, tp)
    assert (s.conv_dim, s.ssm_shape, s.section_dims) == (conv, ssm, dims)


@pytest.mark.parametrize(
    ("model", "conv", "ssm", "dims"),
    [
        ("nemotron-3-nano-30b-a3b", (512, 3), (4, 64, 128), (256, 128, 128)),
        ("nemotron-h-8b", (768, 3), (8, 64, 128), (512, 128, 128)),
    ],
)
def test_tp16_with_eight_groups_keeps_one_group_per_rank(
    model: str, conv: tuple[int, int], ssm: tuple[int, ...], dims: tuple[int, ...]
) -> None:
    """TP a multiple of n_groups: one whole group's B and C per rank, on tp / n_groups ranks each."""
    s = rank_shapes(get_preset(model), 16)
    assert ((s.conv_dim, s.conv_rows), s.ssm_shape, s.section_dims) == (conv, ssm, dims)
    assert s.section_sharded == (True, False, False) and s.section_replicas == (1, 2, 2)


def vllm_mamba2_conv_dim(ssm: Mamba2Dims, tp: int) -> int:
    """layout-spec 5.1, written out: conv_dim / TP with the groups widened by
    `extra_groups_for_head_shards` (0 when TP divides n_groups, else TP - n_groups)."""
    extra = 0 if ssm.n_groups % tp == 0 else tp - ssm.n_groups
    return (ssm.intermediate + 2 * (ssm.n_groups + extra) * ssm.d_state) // tp


def test_mamba2_conv_dims_follow_vllm_group_widening() -> None:
    checked = 0
    for name, spec in PRESETS.items():
        if not isinstance(spec.ssm, Mamba2Dims):
            continue
        for tp in (1, 2, 4, 8, 16, 32):
            if valid_tp(spec, tp):
                assert rank_shapes(spec, tp).conv_dim == vllm_mamba2_conv_dim(spec.ssm, tp), (name, tp)
                checked += spec.ssm.n_groups not in (1, tp) and tp % spec.ssm.n_groups == 0
    assert checked >= 5  # tiny-mamba2-g2 at TP 4 and 8, both Nemotrons at TP 16, ...


def test_documented_nano_state_bytes() -> None:
    nano = get_preset("nemotron-3-nano-30b-a3b")
    got = [(rank_shapes(nano, tp).conv_bytes, rank_shapes(nano, tp).ssm_bytes) for tp in (1, 2, 4)]
    assert got == [(36864, 2097152), (18432, 1048576), (9216, 524288)]


@pytest.mark.parametrize(
    ("model", "convs", "sections", "ssm_rows", "total"),
    [
        (
            "tiny-mamba2",
            (256, 128, 64, 32),
            ((96, 80, 80), (48, 40, 40), (24, 20, 20), (12, 10, 10)),
            (16, 8, 4, 2),
            (6912, 3456, 1728, 864),
        ),
        (
            "tiny-mamba2-g1",
            (116, 68, 44, 32),
            ((96, 10, 10), (48, 10, 10), (24, 10, 10), (12, 10, 10)),
            (16, 8, 4, 2),
            (5232, 2736, 1488, 864),
        ),
        (
            "tiny-mamba2-g2",
            (136, 68, 44, 32),
            ((96, 20, 20), (48, 10, 10), (24, 10, 10), (12, 10, 10)),
            (16, 8, 4, 2),
            (5472, 2736, 1488, 864),
        ),
        (
            "tiny-gdn",
            (352, 176, 88, 44),
            ((96, 96, 160), (48, 48, 80), (24, 24, 40), (12, 12, 20)),
            (16, 8, 4, 2),
            (11904, 5952, 2976, 1488),
        ),
        ("tiny-mamba1", (96, 48, 24, 12), ((96,), (48,), (24,), (12,)), (96, 48, 24, 12), (4224, 2112, 1056, 528)),
    ],
)
def test_tiny_reference_shapes(
    model: str, convs: tuple[int, ...], sections: tuple[tuple[int, ...], ...], ssm_rows: tuple[int, ...], total: tuple[int, ...]
) -> None:
    """hybrid-models.md section 3.2 table."""
    spec = get_preset(model)
    for i, tp in enumerate((1, 2, 4, 8)):
        s = rank_shapes(spec, tp)
        assert (s.conv_dim, s.conv_rows) == (convs[i], 3)
        assert s.section_dims == sections[i]
        assert s.ssm_shape[0] == ssm_rows[i]
        assert s.mamba_bytes == total[i]
        # FA: 256 B per token at TP 1, 128 at TP 2, 4, 8 (KV heads replicated at 4 and 8).
        assert s.fa_bytes_per_token == (256 if tp == 1 else 128)
        assert s.kv_replicated == (tp > 2)
    assert rank_shapes(get_preset("tiny-gdn"), 1).ssm_shape == (16, 10, 12)  # (Hv, Dv, Dk)


def test_speculative_rows_only_for_mamba2_and_gdn() -> None:
    for name, extra in (("tiny-mamba2", 2), ("tiny-gdn", 2), ("tiny-mamba1", 0)):
        spec = dataclasses.replace(get_preset(name), num_spec_tokens=2)
        assert rank_shapes(spec, 2).conv_rows == 3 + extra


# --- invalid TP ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "tp", "why"),
    [
        ("jamba-reasoning-3b", 8, "query heads 20"),
        ("granite-4.0-h-tiny", 8, "query heads 12"),
        ("falcon-h1-7b", 8, "query heads 12"),
        ("tiny-mamba2", 3, "query heads 8"),
        ("tiny-mamba2", 0, ">= 1"),
    ],
)
def test_invalid_tp_names_the_rule(model: str, tp: int, why: str) -> None:
    with pytest.raises(LayoutError, match=why):
        rank_shapes(get_preset(model), tp)
    assert not valid_tp(get_preset(model), tp)


def test_invalid_tp_rules_for_each_dimension() -> None:
    base = get_preset("tiny-mamba2")
    att16 = dataclasses.replace(base.attention, num_heads=16, num_kv_heads=16)
    cases = [
        (dataclasses.replace(base, attention=dataclasses.replace(base.attention, num_kv_heads=3, num_heads=24)), 2, "KV heads 3"),
        (dataclasses.replace(base, ssm=Mamba2Dims(num_heads=12, head_dim=6, n_groups=4, d_state=10)), 8, "SSM heads 12"),
        (dataclasses.replace(base, ssm=Mamba2Dims(num_heads=12, head_dim=6, n_groups=6, d_state=10)), 4, "SSM groups 6"),
        (dataclasses.replace(base, ssm=Mamba2Dims(num_heads=12, head_dim=6, n_groups=3, d_state=10)), 2, "SSM groups 3"),
        (dataclasses.replace(base, attention=att16, ssm=GDNDims(4, 16, 12, 10)), 8, "GDN key heads 4"),
        (dataclasses.replace(base, attention=att16, ssm=GDNDims(8, 12, 12, 10)), 8, "GDN value heads 12"),
        (dataclasses.replace(base, ssm=Mamba1Dims(d_inner=100, d_state=8, dt_rank=8)), 8, "Mamba1 channels 100"),
    ]
    for spec, tp, why in cases:
        with pytest.raises(LayoutError, match=why):
            check_tp(spec, tp)
    with pytest.raises(LayoutError, match="outside TP"):
        conv_channel_index(base, 2, 2)


# --- index functions against a reference derived from what each rank's math needs -------------


def needed_kv_heads(spec: ModelSpec, tp: int, r: int) -> list[int]:
    """KV heads the rank's query heads attend with (GQA: query head h uses KV head h·KV/Hq)."""
    hq, kv = spec.attention.num_heads, spec.attention.num_kv_heads
    per = hq // tp
    return sorted({h * kv // hq for h in range(r * per, (r + 1) * per)})


def needed_conv_channels(spec: ModelSpec, tp: int, r: int) -> list[int]:
    ssm = spec.ssm
    if isinstance(ssm, Mamba2Dims):
        per = ssm.num_heads // tp
        heads = range(r * per, (r + 1) * per)
        groups = sorted({h * ssm.n_groups // ssm.num_heads for h in heads})
        n, i = ssm.d_state, ssm.intermediate
        x = [h * ssm.head_dim + c for h in heads for c in range(ssm.head_dim)]
        b = [i + g * n + c for g in groups for c in range(n)]
        c_ = [i + ssm.n_groups * n + g * n + c for g in groups for c in range(n)]
        return x + b + c_
    if isinstance(ssm, GDNDims):
        per = ssm.num_v_heads // tp
        vheads = range(r * per, (r + 1) * per)
        kheads = sorted({h * ssm.num_k_heads // ssm.num_v_heads for h in vheads})
        key = ssm.num_k_heads * ssm.head_k_dim
        q = [k * ssm.head_k_dim + c for k in kheads for c in range(ssm.head_k_dim)]
        k_ = [key + v for v in q]
        v_ = [2 * key + h * ssm.head_v_dim + c for h in vheads for c in range(ssm.head_v_dim)]
        return q + k_ + v_
    per = ssm.d_inner // tp
    return list(range(r * per, (r + 1) * per))


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    base = get_preset("tiny-mamba2")
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    heads = 8 * draw(st.sampled_from([1, 2]))  # a multiple of every KV count drawn
    att = dataclasses.replace(base.attention, num_kv_heads=kv, num_heads=heads, head_dim=draw(st.sampled_from([2, 3, 4])))
    family = draw(st.sampled_from(["mamba2", "gdn", "mamba1"]))
    ssm: Mamba2Dims | GDNDims | Mamba1Dims
    if family == "mamba2":
        heads = draw(st.sampled_from([8, 16]))
        ssm = Mamba2Dims(
            heads, draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([2, 3]))
        )
    elif family == "gdn":
        hk = draw(st.sampled_from([8, 16]))
        ssm = GDNDims(hk, hk * draw(st.sampled_from([1, 2])), draw(st.sampled_from([2, 3])), draw(st.sampled_from([1, 2])))
    else:
        ssm = Mamba1Dims(d_inner=8 * draw(st.sampled_from([1, 2, 3])), d_state=draw(st.sampled_from([2, 3])), dt_rank=2)
    return dataclasses.replace(base, attention=att, ssm=ssm, name=f"random-{family}")


@LAYOUT_SETTINGS
@given(spec=specs(), tp=st.sampled_from([1, 2, 4, 8, 16]))
def test_index_functions_match_what_each_rank_needs(spec: ModelSpec, tp: int) -> None:
    assume(valid_tp(spec, tp))
    s = rank_shapes(spec, tp)
    for r in range(tp):
        assert kv_head_index(spec, tp, r).tolist() == needed_kv_heads(spec, tp, r)
        chans = conv_channel_index(spec, tp, r)
        assert chans.tolist() == needed_conv_channels(spec, tp, r)
        assert len(chans) == s.conv_dim == sum(s.section_dims)
        rows = ssm_row_index(spec, tp, r)
        assert len(rows) == s.ssm_shape[0]
        assert rows.tolist() == list(range(r * s.ssm_shape[0], (r + 1) * s.ssm_shape[0]))


@LAYOUT_SETTINGS
@given(spec=specs(), tp=st.sampled_from([1, 2, 4, 8, 16]), seed=st.integers(0, 2**32 - 1))
def test_shard_then_unshard_is_the_identity(spec: ModelSpec, tp: int, seed: int) -> None:
    assume(valid_tp(spec, tp))
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal((global_conv_dim(spec), 3))
    ssm = rng.standard_normal(global_ssm_shape(spec))
    kv = rng.standard_normal((5, spec.attention.num_kv_heads, spec.attention.head_dim))
    shards = [
        (conv[conv_channel_index(spec, tp, r)], ssm[ssm_row_index(spec, tp, r)], kv[:, kv_head_index(spec, tp, r)])
        for r in range(tp)
    ]
    out_conv, out_ssm, out_kv = np.full_like(conv, np.nan), np.full_like(ssm, np.nan), np.full_like(kv, np.nan)
    for r, (c, s, k) in enumerate(shards):
        for out, index, part, axis in (
            (out_conv, conv_channel_index(spec, tp, r), c, 0),
            (out_ssm, ssm_row_index(spec, tp, r), s, 0),
            (out_kv, kv_head_index(spec, tp, r), k, 1),
        ):
            taken = np.take(out, index, axis=axis)
            seen = ~np.isnan(taken)
            assert np.array_equal(taken[seen], part[seen]), "replicated copies differ"
            if axis == 0:
                out[index] = part
            else:
                out[:, index] = part
    assert np.array_equal(out_conv, conv) and np.array_equal(out_ssm, ssm) and np.array_equal(out_kv, kv)


def test_mamba2_single_group_keeps_b_and_c_whole() -> None:
    spec = get_preset("tiny-mamba2-g1")
    for tp in (2, 4, 8):
        s = rank_shapes(spec, tp)
        assert s.section_sharded == (True, False, False)
        for r in range(tp):
            chans = conv_channel_index(spec, tp, r)
            assert chans[-20:].tolist() == list(range(96, 116))
    assert rank_shapes(spec, 1).section_sharded == (True, True, True)


def test_mamba2_groups_replicated_on_adjacent_ranks() -> None:
    """Two groups at TP 4 / 8: rank r holds group r // (tp / 2), as vLLM's weight loader gives it."""
    spec = get_preset("tiny-mamba2-g2")  # I = 96, N = 10: B at 96..115, C at 116..135
    for tp in (4, 8):
        s = rank_shapes(spec, tp)
        assert s.section_sharded == (True, False, False) and s.section_replicas == (1, tp // 2, tp // 2)
        for r in range(tp):
            group = r // (tp // 2)
            chans = conv_channel_index(spec, tp, r).tolist()
            assert chans[-20:-10] == list(range(96 + 10 * group, 106 + 10 * group))
            assert chans[-10:] == list(range(116 + 10 * group, 126 + 10 * group))
    assert rank_shapes(spec, 2).section_replicas == (1, 1, 1)
    # Negative control: interleaving the groups (rank r -> group r % 2) would give rank 1 the
    # group its heads do not use; the needs-derived reference tells the two apart.
    assert conv_channel_index(spec, 4, 1).tolist() == needed_conv_channels(spec, 4, 1)
    assert needed_conv_channels(spec, 4, 1)[-20] == 96  # group 0, not group 1 at 106


def test_every_preset_has_consistent_shapes() -> None:
    for name, spec in PRESETS.items():
        for tp in (1, 2, 4, 8, 16):
            if not valid_tp(spec, tp):
                continue
            s = rank_shapes(spec, tp)
            assert s.conv_bytes == sum(s.section_bytes) == s.conv_dim * s.conv_row_bytes, name
            assert s.section_offsets[0] == 0 and s.ssm_row_bytes * s.ssm_shape[0] == s.ssm_bytes, name
