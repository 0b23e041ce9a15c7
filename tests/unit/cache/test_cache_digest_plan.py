"""`state_digests` (with its per-layout-pair `DigestPlan`, memoized) gives, for every source rank,
section and group, the digest of the bytes the definition names, computed here the plain way:
for each global index the source rank holds, in its order, the row of the lowest local rank
holding it, gathered token by token. Over TP pairs both ways (KV heads replicated, Mamba2 groups
replicated), other kernel block sizes, token ranges that start inside a block, and section
subsets; and one flipped byte changes the digest it belongs to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
import xxhash

from shared.cache.digest import SECTIONS, Section, digest_plan, state_digests
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.layout.models import load_model
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.shapes import IntArray, conv_channel_index, kv_head_index, ssm_row_index
from shared.layout.spec import ModelSpec

IndexFn = Callable[[ModelSpec, int, int], IntArray]
Key = tuple[int, str, int]  # (source rank, section, group)


def _random_views(layout: EngineLayout, num_blocks: int, seed: int) -> list[RankViews]:
    views = []
    for r in range(layout.tp):
        cache = RankCache(layout.num_regions, num_blocks, layout.page_bytes, huge_pages=False)
        for region in cache.regions:
            noise = torch.randint(0, 256, (region.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + r))
            region.copy_(noise)
        views.append(RankViews(layout, cache))
    return views


def _holder(index: IndexFn, layout: EngineLayout, wanted: int, own: int | None) -> tuple[int, int]:
    """(local rank, position there) serving global index `wanted`: rank `own` (prefill digests
    its own bytes), else the lowest local rank holding it."""
    for r in [own] if own is not None else range(layout.tp):
        held = index(layout.spec, layout.tp, r).tolist()
        if wanted in held:
            return r, held.index(wanted)
    raise AssertionError(f"no local rank holds index {wanted}")


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _oracle(
    layout: EngineLayout,
    views: Sequence[RankViews],
    block_ids: Sequence[np.ndarray],
    num_tokens: int,
    source: EngineLayout | None,
    tokens_from: int,
    sections: Sequence[Section],
) -> dict[Key, bytes]:
    """The definition, spelled out index by index (no part of the code under test)."""
    spec = layout.spec
    src_tp = layout.tp if source is None else source.tp
    out: dict[Key, bytes] = {}
    for p in range(src_tp):
        own = p if source is None else None
        for g, group in enumerate(layout.groups):
            if group.kind == "attention":
                if "fa" not in sections:
                    continue
                kernel, slot = (torch.from_numpy(a) for a in layout.token_slots(block_ids[g], np.arange(tokens_from, num_tokens)))
                blob = b""
                for region in range(len(group.layers)):
                    for kv in (0, 1):
                        for head in kv_head_index(spec, src_tp, p).tolist():
                            r, pos = _holder(kv_head_index, layout, head, own)
                            blob += _as_bytes(views[r].fa[region][kernel, kv, pos, slot])  # [token, head_dim]
                out[(p, "fa", g)] = xxhash.xxh3_128(blob).digest()
                continue
            block = int(block_ids[g][0])
            index_fns: dict[str, IndexFn] = {"conv": conv_channel_index, "ssm": ssm_row_index}
            for section in ("conv", "ssm"):
                if section not in sections:
                    continue
                blob = b""
                for region in range(len(group.layers)):
                    for wanted in index_fns[section](spec, src_tp, p).tolist():
                        r, pos = _holder(index_fns[section], layout, wanted, own)
                        state = views[r].conv[region] if section == "conv" else views[r].ssm[region]
                        blob += _as_bytes(state[block, pos])
                out[(p, section, g)] = xxhash.xxh3_128(blob).digest()
    return out


def _digests(
    layout: EngineLayout,
    views: Sequence[RankViews],
    block_ids: Sequence[np.ndarray],
    num_tokens: int,
    source: EngineLayout | None,
    tokens_from: int,
    sections: Sequence[Section],
) -> dict[Key, bytes]:
    got = state_digests(layout, views, block_ids, num_tokens, source=source, tokens_from=tokens_from, sections=sections)
    keys = [(d.rank, d.section, d.group) for d in got]
    src_tp = layout.tp if source is None else source.tp
    order = [
        (p, s, g)
        for p in range(src_tp)
        for g, grp in enumerate(layout.groups)
        for s in SECTIONS
        if s in sections and (s == "fa") == (grp.kind == "attention")
    ]
    assert keys == order  # rank by rank, group by group, conv before ssm: the manifest's order
    return {(d.rank, d.section, d.group): d.digest for d in got}


PAIRS = [
    # model, source (tp, kernel block size) or None for the engine's own bytes, local (tp, kernel block size)
    ("tiny-mamba2", None, (1, None)),
    ("tiny-mamba2-g2", None, (4, None)),
    ("tiny-gdn", None, (2, 16)),
    ("tiny-mamba2", (1, None), (1, None)),
    ("tiny-mamba2", (1, None), (2, None)),
    ("tiny-gdn", (2, 16), (1, 32)),
    ("tiny-mamba2-g2", (2, None), (4, None)),
    ("tiny-gdn", (4, 16), (2, None)),
    ("tiny-mamba1", (1, None), (4, None)),
    ("tiny-mamba2-g1", (4, None), (1, 16)),
]


@pytest.mark.parametrize(
    ("model", "source", "local"),
    PAIRS,
    ids=[f"{m}-{'own' if s is None else f'P{s[0]}k{s[1]}'}-D{d[0]}k{d[1]}" for m, s, d in PAIRS],
)
def test_the_digests_are_the_definition_over_every_rank_section_and_token_range(
    model: str, source: tuple[int, int | None] | None, local: tuple[int, int | None]
) -> None:
    spec = load_model(model)
    layout = build_engine_layout(spec, local[0], kernel_block_size=local[1])
    src = None if source is None else build_engine_layout(spec, source[0], kernel_block_size=source[1])
    views = _random_views(layout, 8, seed=7)
    attention = np.array([5, 2, 6, 0])  # out of order, as an allocator hands them out
    block_ids = [attention if g.kind == "attention" else np.array([3]) for g in layout.groups]
    full = 3 * layout.block_size + 5
    size = layout.kernel_block_size
    ranges = [(0, full), (size + 3, full), (0, 1), (full - 1, full), (size, 2 * size), (9, 9)]
    subsets: list[tuple[Section, ...]] = [SECTIONS, ("fa",), ("conv", "ssm"), ("ssm",)]
    for tokens_from, num_tokens in ranges:
        for sections in subsets:
            want = _oracle(layout, views, block_ids, num_tokens, src, tokens_from, sections)
            got = _digests(layout, views, block_ids, num_tokens, src, tokens_from, sections)
            assert got == want, (tokens_from, num_tokens, sections)
    # The plan is built once per pair of layouts and reused.
    assert digest_plan(layout, src) is digest_plan(layout, src)


@pytest.mark.parametrize(("model", "source", "local"), [("tiny-mamba2-g2", 2, 4), ("tiny-gdn", 4, 2)], ids=["P2-D4", "P4-D2"])
def test_one_flipped_byte_changes_the_digest_it_belongs_to_only(model: str, source: int, local: int) -> None:
    spec = load_model(model)
    layout, src = build_engine_layout(spec, local), build_engine_layout(spec, source)
    views = _random_views(layout, 8, seed=3)
    attention = np.array([4, 1, 6])
    spare = iter([0, 2, 3, 5, 7])  # one block of its own per Mamba group: they share the regions
    block_ids = [attention if g.kind == "attention" else np.array([next(spare)]) for g in layout.groups]
    n, start = 2 * layout.block_size + 7, layout.block_size + 1
    before = _digests(layout, views, block_ids, n, src, start, SECTIONS)
    fa_group, mamba_group = layout.attention_group_ids[0], layout.mamba_group_ids[0]
    kernel, slot = (int(a[0]) for a in layout.token_slots(attention, [n - 1]))
    mamba_block = int(block_ids[mamba_group][0])
    # Local rank 0's first KV head, conv channel and SSM row: it serves every source rank holding them.
    flips: list[tuple[torch.Tensor, Section, int, IndexFn]] = [
        (views[0].fa[0][kernel, 1, 0, slot], "fa", fa_group, kv_head_index),  # V of the last token
        (views[0].conv[0][mamba_block, 0], "conv", mamba_group, conv_channel_index),
        (views[0].ssm[0][mamba_block, 0], "ssm", mamba_group, ssm_row_index),
    ]
    for tensor, section, group, index in flips:
        wanted = int(index(spec, local, 0)[0])
        holders = {(p, section, group) for p in range(source) if wanted in index(spec, source, p).tolist()}
        raw = tensor.view(torch.uint8).reshape(-1)
        raw[0] ^= 0x01
        after = _digests(layout, views, block_ids, n, src, start, SECTIONS)
        raw[0] ^= 0x01
        assert holders and {k for k in before if after[k] != before[k]} == holders, section
    assert _digests(layout, views, block_ids, n, src, start, SECTIONS) == before
