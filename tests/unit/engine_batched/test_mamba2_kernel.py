"""The Mamba2 decode kernel (mamba2_kernel.py, built from mamba2_state_step.c by the machine's C
compiler) against the torch path it replaces: the new states are the bits of transformers' order
(state * dA, then + dB x, each rounded), in the pages themselves, with every other byte of the
cache untouched; the torch path's fused multiply-add differs from them in last bits only; the
outputs equal a float64 reference within rounding; a request's bits do not depend on the other requests, their count or
their order; bad arguments are refused before any memory is touched. The torch path, still what a checkpoint
in 16 bits or at TP > 1 runs, stays batch-invariant on its own (test_native_kernels.py runs the
engine with and without the kernels)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from shared.engine.paged.mamba2_kernel import Mamba2StateKernel, mamba2_state_kernel
from tests.unit.engine_batched.helpers import BlockPool, logits_of, paged_engine, prompt_of, start

HEADS, HEAD_DIM, D_STATE, GROUPS = 6, 5, 19, 2  # d_state 19: whole lanes of 8 and a tail of 3
PAGES = 9


@pytest.fixture(scope="module")
def kernel() -> Mamba2StateKernel:
    built = mamba2_state_kernel()
    if built is None:
        pytest.fail("the Mamba2 kernel did not build: this machine has a C compiler, so it must")
    return built


def _inputs(n: int, seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "decay": torch.rand(n, HEADS, generator=g),
        "dt": torch.rand(n, HEADS, generator=g),
        "x": torch.randn(n, HEADS, HEAD_DIM, generator=g),
        "b": torch.randn(n, GROUPS, D_STATE, generator=g),
        "c": torch.randn(n, GROUPS, D_STATE, generator=g),
    }


def _cache(seed: int = 1) -> tuple[Tensor, Tensor]:
    """A cache whose state pages interleave with other bytes (as a region's pages do): the
    whole buffer, and its pages [PAGES, H, P, N] as a strided view."""
    buffer = torch.randn(PAGES, 2, HEADS, HEAD_DIM, D_STATE, generator=torch.Generator().manual_seed(seed))
    return buffer, buffer[:, 0]


def _per_head(t: Tensor) -> Tensor:
    return t.repeat_interleave(HEADS // GROUPS, dim=1)  # [n, G, N] -> [n, H, N]


def _torch_path(states: Tensor, i: dict[str, Tensor], d_skip: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(new states in transformers' order, new states as Mamba2.step computes them (addcmul_),
    outputs as Mamba2.step computes them from its states)."""
    dtb = (i["dt"][:, :, None] * _per_head(i["b"]))[:, :, None, :]
    decayed = states * i["decay"][:, :, None, None]
    ordered = decayed + dtb * i["x"][..., None]
    fused = decayed.clone().addcmul_(dtb, i["x"][..., None])
    y = (fused * _per_head(i["c"])[:, :, None, :]).sum(-1) + i["x"] * d_skip[:, None]
    return ordered, fused, y


def _run(kernel: Mamba2StateKernel, pages: Tensor, ids: list[int], i: dict[str, Tensor], d_skip: Tensor) -> Tensor:
    y = torch.full((len(ids), HEADS, HEAD_DIM), float("nan"))
    kernel(pages, torch.tensor(ids), i["decay"], i["dt"], i["x"], i["b"], i["c"], d_skip, y)
    return y


def test_new_states_are_transformers_order_in_the_pages_and_outputs_within_rounding(kernel: Mamba2StateKernel) -> None:
    ids = [7, 2, 5]
    inputs, d_skip = _inputs(len(ids)), torch.randn(HEADS)
    buffer, pages = _cache()
    before = buffer.clone()
    want_states, fused_states, want_y = _torch_path(pages[ids].clone(), inputs, d_skip)
    y = _run(kernel, pages, ids, inputs, d_skip)
    assert torch.equal(pages[ids], want_states)
    assert torch.allclose(fused_states, want_states, rtol=1e-6, atol=1e-6)  # the torch path: last bits
    changed = torch.zeros(PAGES, 2, dtype=torch.bool)
    changed[ids, 0] = True
    assert torch.equal(buffer[~changed], before[~changed])  # other pages and the bytes between pages
    # The output against float64 (the kernel's sum order is its own, not torch's).
    exact = (want_states.double() * _per_head(inputs["c"]).double()[:, :, None, :]).sum(-1)
    exact += inputs["x"].double() * d_skip.double()[:, None]
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5)
    # Negative control: torch's sum order gives other bits somewhere, so the bit comparisons
    # below can tell two orders apart.
    assert not torch.equal(y, want_y)


def test_a_requests_bits_do_not_depend_on_the_other_requests(kernel: Mamba2StateKernel) -> None:
    d_skip = torch.randn(HEADS)
    alone_inputs = _inputs(1, seed=5)
    _, pages = _cache(seed=3)
    start_state = pages[4].clone()
    alone_y = _run(kernel, pages, [4], alone_inputs, d_skip)
    alone_state = pages[4].clone()
    for others, where in ((1, 0), (3, 2), (8, 5)):
        _, pages = _cache(seed=3 + others)
        pages[4] = start_state
        ids = [p for p in range(PAGES) if p != 4][:others]
        ids.insert(where, 4)
        inputs = _inputs(len(ids), seed=others)
        for name, t in inputs.items():
            t[where] = alone_inputs[name][0]
        y = _run(kernel, pages, ids, inputs, d_skip)
        assert torch.equal(y[where], alone_y[0]), (others, where)
        assert torch.equal(pages[4], alone_state), (others, where)


def test_bad_arguments_are_refused_before_memory_is_touched(kernel: Mamba2StateKernel) -> None:
    inputs, d_skip = _inputs(2), torch.randn(HEADS)
    buffer, pages = _cache()
    before = buffer.clone()
    with pytest.raises(IndexError, match=r"page ids outside 0\.\.8"):
        _run(kernel, pages, [1, PAGES], inputs, d_skip)
    with pytest.raises(IndexError):
        _run(kernel, pages, [-1, 0], inputs, d_skip)
    with pytest.raises(ValueError, match="pages must be fp32"):
        _run(kernel, pages.double(), [0, 1], inputs, d_skip)
    with pytest.raises(ValueError, match="contiguous fp32 CPU tensor"):
        _run(kernel, pages, [0, 1], {**inputs, "x": inputs["x"].transpose(1, 2).contiguous().transpose(1, 2)}, d_skip)
    with pytest.raises(ValueError, match="mamba2 kernel: pages"):
        _run(kernel, pages, [0, 1, 2], inputs, d_skip)  # three ids, two requests' inputs
    assert torch.equal(buffer, before)


def test_the_torch_path_stays_batch_invariant(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("nemotron_h")
    target = prompt_of(11, salt=99)

    def target_logits(batch: int) -> list[Tensor]:
        engine = paged_engine(directory, native=False)
        pool = BlockPool(engine.layout)
        sessions = [start(engine, pool, prompt_of(1 + (5 * i) % 23, salt=i), f"r{i}")[0] for i in range(batch - 1)]
        sessions.insert(batch // 2, start(engine, pool, target, "target")[0])
        out = []
        for _ in range(3):
            engine.step_batch(sessions)
            out.append(logits_of(sessions[batch // 2]))
        return out

    alone = target_logits(1)
    for batch in (2, 17, 33):
        assert all(torch.equal(a, b) for a, b in zip(alone, target_logits(batch))), batch
