"""Disaggregated = colocated, bit for bit, for every family at (P_TP, D_TP) in {1, 2} x {1, 2, 4}.

Prefill and decode are two hf engines on their own paged, TP-sharded caches; the state moves
between them by executing the layout's read lists byte for byte (what NIXL's READ does). Both
boundaries, prompts around block edges, decode crossing a block boundary, greedy and seeded
sampling. The colocated baseline runs the same split on one transformers cache, no blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from shared.engine.hf.colocated import colocated_generate
from shared.engine.hf.tiny_checkpoints import FAMILIES
from shared.engine.sampling import SamplingParams
from tests.unit.engine_hf.helpers import checkpoint, disaggregated, engine

PAIRS = [(p, d) for p in (1, 2) for d in (1, 2, 4)]
MAX_TOKENS = 4
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234)


def _prompt(length: int) -> list[int]:
    return [(7 * i + 5) % 150 + 4 for i in range(length)]  # ids 4..153: no special token


@pytest.mark.parametrize("family", FAMILIES)
def test_disaggregated_equals_colocated_at_every_tp_pair(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    ckpt = checkpoint(directory)
    for p_tp, d_tp in PAIRS:
        for boundary in ("full", "n-1"):
            prefill, decode = engine(directory, p_tp, boundary=boundary), engine(directory, d_tp, boundary=boundary)
            bs_p, bs_d = prefill.layout.block_size, decode.layout.block_size
            # Prefill's block edges, and a prompt 2 short of a decode block edge: decode crosses it.
            lengths = {1, 2, bs_p - 1, bs_p, bs_p + 1} if (p_tp, d_tp) == (1, 1) else {1, bs_p + 1}
            for length in sorted(lengths | {2 * bs_d - 2}):
                prompt = _prompt(length)
                want = colocated_generate(ckpt, prompt, MAX_TOKENS, boundary=boundary, stop_at_eos=False).token_ids
                run = disaggregated(prefill, decode, prompt, MAX_TOKENS)
                assert run.tokens == want, (family, p_tp, d_tp, boundary, length)
                assert run.moved > 0 or (boundary == "n-1" and length == 1)
        sampled_prompt = _prompt(9)
        want = colocated_generate(ckpt, sampled_prompt, 6, sampling=SAMPLED, stop_at_eos=False).token_ids
        assert want != colocated_generate(ckpt, sampled_prompt, 6, stop_at_eos=False).token_ids  # really sampled
        assert (
            disaggregated(engine(directory, p_tp), engine(directory, d_tp), sampled_prompt, 6, sampling=SAMPLED).tokens == want
        ), (family, p_tp, d_tp, "sampled")
