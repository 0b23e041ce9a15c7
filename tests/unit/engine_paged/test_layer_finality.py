"""Layer parts: in the last prefill chunk every engine reports each layer (`on_layer`) as soon
as its state in the blocks is final, in layer order, without changing a bit of what it writes.

Each report snapshots the reported layer from the blocks; after `compute` the snapshot must
still be the layer's state (nothing wrote it later). The negative control snapshots the NEXT
layer at the same moment: its last chunk is not written yet, so it must differ (this is what
shows the reports come before the later layers are written, and that the check can fail)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor

import shared.engine.hf.engine as hf_engine_module
from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.engine.hf.checkpoint import decoder_layers
from shared.engine.hf.engine import HfEngine
from shared.engine.hf.tiny_checkpoints import FAMILIES
from shared.engine.paged_state import PagedStateStore
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import RequestBlocks
from shared.engine.reference_engine import ReferenceEngine
from shared.engine.synthetic import SyntheticEngine
from shared.layout.boundary import Boundary
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.presets import TINY_PRESETS, pattern_to_kinds
from shared.layout.spec import ModelSpec
from tests.unit.engine_hf.helpers import NUM_BLOCKS, blocks_for, checkpoint, spec_of

pytestmark = pytest.mark.timeout(120)

Engine = ReferenceEngine | SyntheticEngine | HfEngine
PROMPT = list(b"Layer parts: each layer final in turn.")  # 38 tokens
TP = 2
HF_CHUNK = 16

# Several layer kinds: parallel (attention and SSM), SSM, MLP only (nothing cached), attention.
MIXED: ModelSpec = dataclasses.replace(TINY_PRESETS["tiny-gdn"], name="tiny-gdn-psma", layer_kinds=pattern_to_kinds("PSMA"))
SPECS: dict[str, ModelSpec] = {
    "tiny-mamba2": TINY_PRESETS["tiny-mamba2"],
    "tiny-mamba1": TINY_PRESETS["tiny-mamba1"],
    "psma": MIXED,
}
CASES = [
    "reference:tiny-mamba2",
    "reference:tiny-mamba1",
    "reference:psma",
    "synthetic:tiny-mamba2",
    "synthetic:psma",
    *(f"hf:{family}" for family in FAMILIES),
    "hf-n-1:nemotron_h",
]


@dataclass
class Case:
    name: str
    make: Callable[[], Engine]  # a fresh engine on fresh (zeroed) caches
    chunk: int  # hf: the engine's --prefill-chunk-tokens (chunks must be these); else 0


def _ranks(spec: ModelSpec) -> tuple[EngineLayout, list[RankViews]]:
    layout = build_engine_layout(spec, TP)
    return layout, [
        RankViews(layout, RankCache(layout.num_regions, NUM_BLOCKS, layout.page_bytes, huge_pages=False)) for _ in range(TP)
    ]


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest, hf_checkpoint: Callable[[str], str]) -> Case:
    kind, name = request.param.split(":")
    if kind == "reference":
        spec = SPECS[name]
        return Case(request.param, lambda: ReferenceEngine(*_ranks(spec)), 0)
    if kind == "synthetic":
        spec = SPECS[name]
        return Case(request.param, lambda: SyntheticEngine(*_ranks(spec)), 0)
    directory = hf_checkpoint(name)
    boundary: Boundary = "n-1" if kind == "hf-n-1" else "full"

    def make() -> HfEngine:
        layout, ranks = _ranks(spec_of(directory))
        return HfEngine(layout, ranks, checkpoint(directory), boundary=boundary, prefill_chunk_tokens=HF_CHUNK)

    return Case(request.param, make, HF_CHUNK)


def ends_of(case: Case, engine: Engine) -> list[int]:
    n = engine.num_prefill_tokens(len(PROMPT))
    return chunk_ends(0, n, case.chunk) if case.chunk else [5, 17, n]


def layer_state(engine: Engine, blocks: RequestBlocks, layer: int, length: int) -> list[Tensor]:
    """What layer `layer` holds in the blocks: K/V of `length` tokens and / or conv and SSM state."""
    store = PagedStateStore(engine.layout, engine.ranks, blocks)
    out: list[Tensor] = []
    if layer in engine.spec.attention_layers:
        out += store.read_kv(layer, length)
    if layer in engine.spec.ssm_layers:
        out += store.read_ssm(layer)
    return out


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def same_caches(a: Engine, b: Engine) -> bool:
    return all(x.equal(y) for ra, rb in zip(a.ranks, b.ranks) for x, y in zip(ra.cache.regions, rb.cache.regions))


@dataclass
class Parts:
    blocks: RequestBlocks
    n: int
    results: list[int | None] = field(default_factory=list)
    reports: list[tuple[int, int]] = field(default_factory=list)  # (call, layer)
    at_report: dict[int, list[Tensor]] = field(default_factory=dict)  # layer l when l is reported
    next_at_report: dict[int, list[Tensor]] = field(default_factory=dict)  # layer l + 1 then


def run_in_parts(engine: Engine, ends: list[int], *, report: bool = True) -> Parts:
    parts = Parts(blocks_for(engine.layout, len(PROMPT)), engine.num_prefill_tokens(len(PROMPT)))
    run = engine.start_prefill(PROMPT, parts.blocks)
    for call, end in enumerate(ends):

        def on_layer(layer: int, call: int = call) -> None:
            parts.reports.append((call, layer))
            parts.at_report[layer] = layer_state(engine, parts.blocks, layer, parts.n)  # reads are copies
            if layer + 1 < engine.spec.num_layers:
                parts.next_at_report[layer + 1] = layer_state(engine, parts.blocks, layer + 1, parts.n)

        parts.results.append(run.compute(end, on_layer if report else None))
    return parts


def test_each_layer_is_reported_once_in_order_in_the_last_call_with_its_final_state(case: Case) -> None:
    engine = case.make()
    ends = ends_of(case, engine)
    assert len(ends) >= 3
    parts = run_in_parts(engine, ends)
    layers = range(engine.spec.num_layers)
    assert parts.reports == [(len(ends) - 1, layer) for layer in layers]
    for layer in layers:
        assert same(parts.at_report[layer], layer_state(engine, parts.blocks, layer, parts.n)), (
            f"layer {layer} written after its report"
        )
    # The bits: the same chunks without on_layer, and one `prefill`.
    plain = case.make()
    plain_parts = run_in_parts(plain, ends, report=False)
    whole = case.make()
    first = whole.prefill(PROMPT, parts.blocks)
    assert same_caches(engine, plain) and same_caches(engine, whole)
    assert parts.results[:-1] == [None] * (len(ends) - 1)
    assert parts.results[-1] == plain_parts.results[-1] == first
    assert (first is not None) == (isinstance(engine, HfEngine) and engine.boundary == "full")


def test_negative_control_the_next_layer_is_not_final_when_a_layer_is_reported(case: Case) -> None:
    engine = case.make()
    ends = ends_of(case, engine)
    parts = run_in_parts(engine, ends)
    last_start = ends[-2]
    checked = 0
    for layer, early in parts.next_at_report.items():
        final = layer_state(engine, parts.blocks, layer, parts.n)
        if not final:
            continue  # an MLP-only layer: nothing to see
        assert not same(early, final), f"layer {layer} already final when layer {layer - 1} was reported"
        if layer in engine.spec.attention_layers:
            (k, v), (fk, fv) = early[:2], final[:2]
            # Earlier chunks' K/V were final already; the last chunk's was not written yet.
            assert torch.equal(k[:last_start], fk[:last_start]) and torch.equal(v[:last_start], fv[:last_start])
            assert not torch.equal(k[last_start:], fk[last_start:])
        checked += 1
    assert checked >= 2


class Stop(Exception):
    pass


def test_an_exception_from_on_layer_propagates_out_of_compute(case: Case) -> None:
    engine = case.make()
    ends = ends_of(case, engine)
    blocks = blocks_for(engine.layout, len(PROMPT))
    run = engine.start_prefill(PROMPT, blocks)
    seen: list[int] = []

    def stop_at_1(layer: int) -> None:
        seen.append(layer)
        if layer == 1:
            raise Stop

    for end in ends[:-1]:
        run.compute(end, stop_at_1)
    assert seen == []  # not called before the last chunk
    with pytest.raises(Stop):
        run.compute(ends[-1], stop_at_1)
    assert seen == [0, 1]
    if isinstance(engine, HfEngine):  # the hooks are gone: the shared model computes as before
        layers = decoder_layers(engine.checkpoint.model)
        assert layers is not None and not any(m._forward_hooks for m in layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_layers_are_found_for_every_family(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    layers = decoder_layers(checkpoint(directory).model)
    assert layers is not None and len(layers) == spec_of(directory).num_layers


def test_hf_without_decoder_layers_writes_after_the_forward_then_reports_every_layer(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = hf_checkpoint("nemotron_h")

    def make() -> HfEngine:
        layout, ranks = _ranks(spec_of(directory))
        return HfEngine(layout, ranks, checkpoint(directory), prefill_chunk_tokens=HF_CHUNK)

    monkeypatch.setattr(hf_engine_module, "decoder_layers", lambda model: None)
    engine = make()
    ends = ends_of(Case("fallback", make, HF_CHUNK), engine)
    parts = run_in_parts(engine, ends)
    assert parts.reports == [(len(ends) - 1, layer) for layer in range(engine.spec.num_layers)]
    for layer, early in parts.next_at_report.items():  # everything was written before the first report
        assert same(early, layer_state(engine, parts.blocks, layer, parts.n))
    whole = make()
    assert whole.prefill(PROMPT, parts.blocks) == parts.results[-1]
    assert same_caches(engine, whole)
