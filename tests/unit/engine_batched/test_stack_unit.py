"""The fewest rows a decode step's stack needs (stack_unit.py): found from the ops a step runs,
the ops that may round otherwise in a scalar tail asking for whole vector steps in each of
their tensors and the others for nothing; and the negative control: a stack narrower than the
traced unit makes a request's logits depend on its batch."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged import engine as paged_engine_module
from shared.engine.paged.stack_unit import stack_unit, step_rows, trace_rows
from tests.unit.engine_batched.helpers import BlockPool, logits_of, paged_engine, prompt_of, start

ROWS = trace_rows(1, torch.float32)


def _unit(shape: tuple[int, ...], op: Callable[[Tensor], object], dtype: torch.dtype = torch.float32) -> int:
    """The unit `op` on a tensor of `shape` (-1: the stack's rows) asks for."""
    rows = trace_rows(1, dtype)
    x = torch.randn([rows if d == -1 else d for d in shape]).to(dtype)  # made outside the recorder
    return stack_unit(lambda _rows: op(x), rows)[1]


def test_ops_that_may_round_otherwise_ask_for_whole_vector_steps() -> None:
    assert _unit((-1, 8), torch.exp) == 4  # 8 fp32 a row: 4 rows make one 128-byte step
    assert _unit((-1, 1), torch.sigmoid) == 32
    assert _unit((-1, 8), F.silu, torch.bfloat16) == 8
    assert _unit((-1, 256), F.softplus) == 1
    assert _unit((-1, 1), lambda x: x.to(torch.bfloat16)) == 64  # a float cast may round otherwise
    assert _unit((-1, 1), lambda x: x.add(x, alpha=2)) == 32  # fused in the vector loop
    assert _unit((-1, 1), lambda x: x.pow(3)) == 32
    assert _unit((-1, 4), lambda x: x.sum(0)) == 8  # not a row's own sum
    assert _unit((2, -1, 3), torch.exp) == 32  # rows inside: the inner loop after them counts


def test_ops_that_round_alike_ask_for_nothing() -> None:
    for op in (
        lambda x: x * 2,
        lambda x: x + 1,
        lambda x: x - x,
        lambda x: x / 3,
        lambda x: torch.rsqrt(x.abs() + 1),
        lambda x: torch.sqrt(x.abs()),
        lambda x: x.pow(2),
        lambda x: torch.where(x > 0, x, -x),
        lambda x: x.clamp(-1, 1),
        lambda x: x.sum(-1),
        lambda x: x.mean(-1, keepdim=True),
        lambda x: (x > 0).to(torch.float32),  # integers to floats: one IEEE rounding
    ):
        assert _unit((-1, 1), op) == 1
        assert _unit((-1, 3), op) == 1


def test_step_rows_are_whole_units_in_the_calls_rows() -> None:
    assert [step_rows(n, 4) for n in (1, 4, 5, 12, 13, 16, 17, 40)] == [4, 4, 8, 12, 16, 16, 32, 48]
    assert [step_rows(n, 8) for n in (1, 9, 17)] == [8, 16, 32]
    assert [step_rows(n, 32) for n in (1, 32, 33)] == [32, 32, 64]


def test_the_first_invariant_step_finds_the_unit(hf_checkpoint: Callable[[str], str]) -> None:
    engine = paged_engine(hf_checkpoint("nemotron_h"))
    pool = BlockPool(engine.layout)
    session, _ = start(engine, pool, prompt_of(5, salt=1), "r0")
    assert engine.decode_stack_unit is None
    engine.step_batch([session])
    unit = engine.decode_stack_unit
    # Its narrowest tensors that may round otherwise are [rows, heads] time steps: fewer rows
    # than a whole fp32 stack, and a power of two of them.
    assert unit is not None and unit < 32 and 32 % unit == 0


TARGET = prompt_of(11, salt=99)
# Whether a sigmoid rounds otherwise in the scalar loop than in the vector loop depends on its
# value (most values round alike): enough steps that some gate value of the target's does, on
# any machine (one did only from the fourth step here; the state then carries the difference).
STEPS = 16


def _target_logits(directory: str, batch: int) -> list[Tensor]:
    engine = paged_engine(directory)
    pool = BlockPool(engine.layout)
    sessions = [start(engine, pool, prompt_of(1 + (5 * i) % 23, salt=i), f"r{i}")[0] for i in range(batch - 1)]
    target, _ = start(engine, pool, TARGET, "target")
    sessions.insert(batch // 2, target)
    out = []
    for _ in range(STEPS):
        engine.step_batch(sessions)
        out.append(logits_of(target))
    return out[1:]  # after the traced first step


def test_negative_control_a_stack_below_the_unit_depends_on_the_batch(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-Next's shared-expert gate is a sigmoid of one value a row: it needs stacks of 32 fp32
    rows. Stacks of 4 give the target other bits beside 32 others (48 rows: its gate in the vector
    loop) than alone (4 rows: in the scalar loop); with the traced unit, the same bits."""
    directory = hf_checkpoint("qwen3_next")
    alone, beside = _target_logits(directory, 1), _target_logits(directory, 33)
    assert all(torch.equal(a, b) for a, b in zip(alone, beside))
    traced = paged_engine_module.stack_unit
    monkeypatch.setattr(paged_engine_module, "stack_unit", lambda step, rows: (traced(step, rows)[0], 4))
    alone, beside = _target_logits(directory, 1), _target_logits(directory, 33)
    assert not all(torch.equal(a, b) for a, b in zip(alone, beside))


ROUND_ALIKE: dict[str, Callable[[Tensor], Tensor]] = {
    "mul": lambda x: x * 1.37,
    "add": lambda x: x + 0.61,
    "sub": lambda x: x - 0.29,
    "div": lambda x: x / 3.1,
    "sqrt": lambda x: torch.sqrt(x.abs()),
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.1),
    "reciprocal": lambda x: torch.reciprocal(x),
    "square": lambda x: x.pow(2),
    "clamp": lambda x: x.clamp(-1.5, 1.5),
    "maximum": lambda x: torch.maximum(x, -x),
    "sum": lambda x: x.sum(-1, keepdim=True),
    "mean": lambda x: x.mean(-1, keepdim=True),
    "bool to float": lambda x: (x > 0.3).to(x.dtype),
}
ALIKE_IN_FP32_ONLY = {"rsqrt"}


def _first_rows_change(fn: Callable[[Tensor], Tensor], dtype: torch.dtype) -> bool:
    """Whether the first rows of a [rows, width] tensor get other bits from `fn` as the row count
    grows (widths 1..9: every length's scalar tail)."""
    torch.manual_seed(5)
    for width in range(1, 10):
        x = (4 * torch.randn(96, width)).to(dtype)
        first = fn(x[:3].contiguous())
        if any(not torch.equal(fn(x[:rows].contiguous())[:3], first) for rows in range(4, 97)):
            return True
    return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_called_alike_round_alike_at_every_length(dtype: torch.dtype) -> None:
    """What stack_unit.py claims, on this machine: these ops keep every row's bits at every row
    count, and the recorder asks them for no rows; a 16-bit rsqrt does not, and is asked for
    whole vector steps."""
    for name, fn in ROUND_ALIKE.items():
        alike = dtype == torch.float32 or name not in ALIKE_IN_FP32_ONLY
        assert (_unit((-1, 3), fn, dtype) == 1) == alike, name
        if alike:
            assert not _first_rows_change(fn, dtype), name
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert _first_rows_change(ROUND_ALIKE["rsqrt"], dtype)  # the check sees a difference


def test_negative_control_sigmoid_rounds_otherwise_in_the_tail() -> None:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("measured on AVX-512's 32-value steps")
    assert _first_rows_change(torch.sigmoid, torch.float32)


FRESH_PROCESS = """
import sys
import torch
from shared.engine.paged.stack_unit import stack_unit
x = torch.randn(224, 8)
stack_unit(lambda rows: torch.exp(x), 224)
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_the_recorder_does_not_import_the_compiler() -> None:
    """A dispatch mode's first op imports torch's compiler (hundreds of modules, tens of MB kept
    for the process's life) unless the mode opts out of its wrapping: the recorder does."""
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
