"""The paged engine's math against transformers' (the hf engine), every supported family and the
checkpoint variants it serves (Nemotron-H's routed experts, scaled RoPE), fp32 and bf16, both
boundaries: prefill on TP 1, the state moved byte for byte into a TP 2 decode engine, then
greedy decode; logits within tolerance and the same greedy tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shared.cache.model_views import RankViews
from shared.cache.regions import RankCache
from shared.config.settings import default_engine
from shared.engine.paged.attention import Attention, Rope
from shared.engine.paged.checkpoint import PagedCheckpoint
from shared.engine.paged.engine import PagedEngine
from shared.engine.paged.families import MOE_FAMILIES, SUPPORTED_FAMILIES
from shared.engine.paged.ffn import Moe
from shared.engine.paged.model import Model, Parallel
from shared.engine.paged.routers import GroupedSigmoidRouter
from shared.engine.paged.support import paged_serves
from shared.layout.page import build_engine_layout
from tests.unit.engine_batched.helpers import paged_engine, prompt_of
from tests.unit.engine_batched.variants import PAGED_VARIANTS, ROUTED_VARIANTS
from tests.unit.engine_hf.helpers import Run, disaggregated, spec_of
from tests.unit.engine_hf.helpers import engine as hf_engine

# Max |logit difference| against transformers. fp32: the paged engine's SSD scan, conv step and
# eager attention sum in other orders than transformers' chunked scan and SDPA, so ulps of the
# state add up over a few layers and steps (measured up to about 4e-5). bf16: every cast to bf16
# rounds at 2^-8 relative, and a rounding that lands differently moves a logit by up to ~0.1.
TOLERANCE = {"fp32": 1e-4, "bf16": 0.25}
MAX_TOKENS = 16
# bf16 with routed experts: the tiny checkpoints' top-k router logits lie within 0.02 of the next
# (one bf16 ulp of a logit near 4), so a hidden state rounded differently by an ulp may route a
# token to another expert: a discrete jump of the logits (seen up to ~2), not drift. There the
# median difference over all steps and prompts is held to the tolerance, and tokens are not.
LENGTHS = (1, 9, 21)


def _compare_tokens(want: list[int], got: list[int], want_logits: list[torch.Tensor | None], tol: float) -> None:
    """Equal tokens, except that after a step where transformers' best two logits lie within
    the tolerance (a near tie either may break) the runs may part."""
    for i, (w, g) in enumerate(zip(want, got)):
        logits = want_logits[i]
        if logits is not None:
            top = torch.topk(logits.float(), 2).values
            if float(top[0] - top[1]) < 2 * tol:
                return
        assert w == g, (i, want, got)


def _compare_with_hf(directory: str, dtype: str, *, routed: bool) -> None:
    tol = TOLERANCE[dtype]
    routed_bf16 = dtype == "bf16" and routed
    diffs: list[float] = []
    for boundary in ("full", "n-1"):
        hf_p, hf_d = (
            hf_engine(directory, 1, dtype=dtype, boundary=boundary),
            hf_engine(directory, 1, dtype=dtype, boundary=boundary),
        )
        pg_p = paged_engine(directory, 1, dtype=dtype, boundary=boundary, num_blocks=24)
        pg_d = paged_engine(directory, 2, dtype=dtype, boundary=boundary, num_blocks=24)
        for length in LENGTHS:
            prompt = prompt_of(length, salt=length)
            want = disaggregated(hf_p, hf_d, prompt, MAX_TOKENS)
            got = disaggregated(pg_p, pg_d, prompt, MAX_TOKENS)  # type: ignore[arg-type]
            if not routed_bf16:
                _compare_tokens(want.tokens, got.tokens, want.logits, tol)
            diffs += _same_feed_diffs(want, got)
            assert routed_bf16 or max(diffs, default=0.0) <= tol, (directory, dtype, boundary, length, diffs)
    assert float(torch.tensor(diffs).median()) <= tol, diffs


def _same_feed_diffs(want: Run, got: Run) -> list[float]:
    """Max |logit difference| of each step while both runs were fed the same tokens."""
    diffs = []
    for i, (w, g) in enumerate(zip(want.logits, got.logits)):
        if want.tokens[:i] != got.tokens[:i]:
            break
        if w is not None and g is not None:
            diffs.append(float((w.float() - g.float()).abs().max()))
    return diffs


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_paged_matches_hf(family: str, dtype: str, hf_checkpoint: Callable[[str], str]) -> None:
    _compare_with_hf(hf_checkpoint(family), dtype, routed=family in MOE_FAMILIES)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", PAGED_VARIANTS)
def test_routed_experts_and_scaled_rope_match_hf(variant: str, dtype: str, variant_checkpoint: Callable[[str], str]) -> None:
    """Nemotron-H's routed-expert layers and the RoPE types the paged engine computes."""
    directory = variant_checkpoint(variant)
    assert paged_serves(directory) and default_engine(directory) == "paged"
    _compare_with_hf(directory, dtype, routed=variant in ROUTED_VARIANTS)


def _without_correction_bias(model: Model) -> None:
    for layer in model.layers:
        for sub in layer.sublayers:
            if isinstance(sub.mixer, Moe) and isinstance(sub.mixer.router, GroupedSigmoidRouter):
                sub.mixer.router.correction_bias = torch.zeros_like(sub.mixer.router.correction_bias)


def _unscaled_rope(model: Model) -> None:
    for layer in model.layers:
        for sub in layer.sublayers:
            mixer = sub.mixer.attention if isinstance(sub.mixer, Parallel) else sub.mixer
            if isinstance(mixer, Attention) and mixer.rope is not None:
                dim, theta = mixer.rope.dim, 10000.0  # the variants' rope_theta
                inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
                mixer.rope = Rope(inv_freq)


@pytest.mark.parametrize(
    ("variant", "damage"),
    [
        ("moe", _without_correction_bias),
        ("rope-linear", _unscaled_rope),
        ("rope-llama3", _unscaled_rope),
        ("rope-yarn", _unscaled_rope),
    ],
)
def test_negative_control_the_feature_left_out_differs_from_hf(
    variant: str, damage: Callable[[Model], None], variant_checkpoint: Callable[[str], str]
) -> None:
    """The same comparison with the router's correction bias, or the RoPE scaling, left out of
    the paged model: far outside the tolerance (the features are what makes it match)."""
    directory = variant_checkpoint(variant)
    checkpoint = PagedCheckpoint(directory, dtype="fp32")
    damage(checkpoint.model)
    layout = build_engine_layout(spec_of(directory), 1)

    def damaged() -> PagedEngine:
        ranks = [RankViews(layout, RankCache(layout.num_regions, 24, layout.page_bytes, huge_pages=False))]
        return PagedEngine(layout, ranks, checkpoint, boundary="n-1")

    # At n-1 the first logits compared follow the prompt alone, whatever the tokens drawn later.
    prompt = prompt_of(21, salt=21)
    want = disaggregated(hf_engine(directory, 1, boundary="n-1"), hf_engine(directory, 1, boundary="n-1"), prompt, MAX_TOKENS)
    got = disaggregated(damaged(), damaged(), prompt, MAX_TOKENS)  # type: ignore[arg-type]
    assert max(_same_feed_diffs(want, got)) > 100 * TOLERANCE["fp32"]
