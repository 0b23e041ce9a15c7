"""The paged engine with its C kernels (--native-kernels on, the default: the Mamba2 conv and
state updates and the decode attention, fp32 on a CPU) against the same engine without them and against
transformers, every family: one batch of prompts decodes to the same greedy tokens with the
kernels as without, logits within rounding; one request through a TP 1 decode engine (where the
kernels run) gives transformers' tokens with logits within the fp32 tolerance."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from shared.engine.paged.attention_kernel import AttentionKernel
from shared.engine.paged.conv_kernel import ConvStepKernel
from shared.engine.paged.families import SUPPORTED_FAMILIES
from shared.engine.paged.mamba2_kernel import Mamba2StateKernel
from tests.unit.engine_batched.helpers import BlockPool, logits_of, paged_engine, prompt_of, start
from tests.unit.engine_hf.helpers import disaggregated
from tests.unit.engine_hf.helpers import engine as hf_engine

STEPS = 12
MAMBA2_FAMILIES = ("nemotron_h", "bamba", "granitemoehybrid", "falcon_h1")
TOLERANCE = 1e-4  # fp32, as test_paged_vs_hf.py: against transformers and between the paths


def _greedy(directory: str, native: bool, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[Tensor]]:
    """Every prompt's greedy tokens and last logits, decoded together in one batch."""
    engine = paged_engine(directory, native=native)
    pool = BlockPool(engine.layout)
    sessions, tokens = [], []
    for i, prompt in enumerate(prompts):
        session, first = start(engine, pool, prompt, f"r{i}")
        sessions.append(session)
        tokens.append([] if first is None else [first])
    for _ in range(steps):
        for out, token in zip(tokens, engine.step_batch(sessions)):
            out.append(token)
    return tokens, [logits_of(s) for s in sessions]


def _counting(monkeypatch: pytest.MonkeyPatch, kernel: type[Any]) -> list[int]:
    """Counts the calls of `kernel`'s instances (so the test knows the kernels ran)."""
    calls: list[int] = []
    call = kernel.__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(kernel, "__call__", counted)
    return calls


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_the_kernels_decode_as_the_torch_path_and_transformers(
    family: str, hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = hf_checkpoint(family)
    prompts = [prompt_of(n, salt=n) for n in (1, 9, 21)]
    attention_calls, mamba2_calls = _counting(monkeypatch, AttentionKernel), _counting(monkeypatch, Mamba2StateKernel)
    conv_calls = _counting(monkeypatch, ConvStepKernel)
    native_tokens, native_logits = _greedy(directory, True, prompts, STEPS)
    assert attention_calls  # every family has attention layers
    assert bool(mamba2_calls) == (family in MAMBA2_FAMILIES) and len(conv_calls) == len(mamba2_calls)
    del attention_calls[:], mamba2_calls[:], conv_calls[:]
    torch_tokens, torch_logits = _greedy(directory, False, prompts, STEPS)
    assert not attention_calls and not mamba2_calls and not conv_calls
    assert native_tokens == torch_tokens
    for a, b in zip(native_logits, torch_logits):
        assert torch.allclose(a, b, rtol=0, atol=TOLERANCE)
    # Against transformers, one request through a TP 1 decode engine (where the kernels run).
    hf_p, hf_d = hf_engine(directory, 1), hf_engine(directory, 1)
    pg_p, pg_d = paged_engine(directory, num_blocks=24), paged_engine(directory, num_blocks=24)
    want = disaggregated(hf_p, hf_d, prompts[1], STEPS)
    got = disaggregated(pg_p, pg_d, prompts[1], STEPS)  # type: ignore[arg-type]
    assert want.tokens == got.tokens
    for w, g in zip(want.logits, got.logits):
        if w is not None and g is not None:
            assert float((w.float() - g.float()).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next", "falcon_h1"])
def test_the_kernels_give_the_same_bits_at_any_decode_tp(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    """At TP 2 the heads lie on two ranks: the kernels run on gathered copies, and a request's
    logits are the TP 1 engine's bits (disaggregated == colocated across TP degrees). Negative
    control: a TP 2 decode on the torch path gives other bits."""
    directory = hf_checkpoint(family)
    prompt = prompt_of(13, salt=4)
    prefill = paged_engine(directory, num_blocks=24)

    def logits(tp: int, native: bool) -> list[Tensor]:
        run = disaggregated(prefill, paged_engine(directory, tp, num_blocks=24, native=native), prompt, STEPS)  # type: ignore[arg-type]
        return [t for t in run.logits if t is not None]

    one = logits(1, True)
    assert all(torch.equal(a, b) for a, b in zip(one, logits(2, True), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(one, logits(2, False), strict=True))
