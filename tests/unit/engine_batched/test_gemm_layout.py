"""The GEMM weights' layout (gemm_layout.py): every weight a forward multiplies by, in every
family, reaches the GEMM stored [in, out] on a CPU in fp32, with the checkpoint's values;
16-bit weights keep the checkpoint's layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from shared.engine.paged import tiles
from shared.engine.paged.checkpoint import PagedCheckpoint
from shared.engine.paged.families import SUPPORTED_FAMILIES, check_family
from shared.engine.paged.gemm_layout import gemm_weight, lay_out
from shared.engine.paged.weights import Weights, load_config
from tests.unit.engine_batched.helpers import BlockPool, paged_engine, prompt_of, start
from tests.unit.engine_batched.variants import ROUTED_VARIANTS


class _Recorder:
    """Stands in for torch.nn.functional in tiles.py: every weight `linear` multiplies by."""

    def __init__(self) -> None:
        self.weights: list[Tensor] = []

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        self.weights.append(weight)
        return F.linear(x, weight, bias)


def _stored_transposed(weight: Tensor) -> bool:
    return weight.t().is_contiguous()  # [in, out] row-major (a dim of one takes any stride)


def _weights_multiplied(directory: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """The weights of every GEMM of two prefills (batch-invariant and not) and a decode step."""
    recorder = _Recorder()
    monkeypatch.setattr(tiles, "F", recorder)
    for invariant in (True, False):
        engine = paged_engine(directory, dtype=dtype, invariant=invariant)
        pool = BlockPool(engine.layout)
        sessions = [start(engine, pool, prompt_of(n, salt=n), f"r{n}")[0] for n in (3, 9)]
        engine.step_batch(sessions)
    assert recorder.weights
    return recorder.weights


def _checkpoint_dirs(hf_checkpoint: Callable[[str], str], variant_checkpoint: Callable[[str], str]) -> list[str]:
    return [hf_checkpoint(f) for f in SUPPORTED_FAMILIES] + [variant_checkpoint(v) for v in ROUTED_VARIANTS]


def test_every_fp32_gemm_weight_is_stored_transposed(
    hf_checkpoint: Callable[[str], str], variant_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for directory in _checkpoint_dirs(hf_checkpoint, variant_checkpoint):
        weights = _weights_multiplied(directory, "fp32", monkeypatch)
        left = [tuple(w.shape) for w in weights if not _stored_transposed(w)]
        assert not left, (directory, left)


def test_bf16_weights_keep_the_checkpoint_layout(hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    weights = _weights_multiplied(hf_checkpoint("nemotron_h"), "bf16", monkeypatch)
    assert all(w.is_contiguous() for w in weights)


def test_negative_control_a_model_not_laid_out_is_seen(hf_checkpoint: Callable[[str], str]) -> None:
    """The check above can fail: the model as the builder makes it has row-major weights."""
    directory = hf_checkpoint("nemotron_h")
    config = load_config(directory)
    model: Any = check_family(str(config.model_type))(config, Weights(directory, torch.float32, torch.device("cpu")))
    assert not _stored_transposed(model.lm_head)
    lay_out(model)
    assert _stored_transposed(model.lm_head)


def test_the_layout_keeps_values_and_shape(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("nemotron_h")
    checkpoint = PagedCheckpoint(directory, dtype="fp32")
    raw = Weights(directory, torch.float32, torch.device("cpu"))
    head = raw.get("lm_head.weight")
    assert torch.equal(checkpoint.model.lm_head, head) and checkpoint.model.lm_head.shape == head.shape
    bf16, vector = head.to(torch.bfloat16), torch.ones(3)
    assert gemm_weight(bf16) is bf16 and gemm_weight(vector) is vector  # left as they are


def test_a_head_tied_to_the_embedding_is_held_once(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("nemotron_h")
    config = load_config(directory)
    model: Any = check_family(str(config.model_type))(config, Weights(directory, torch.float32, torch.device("cpu")))
    model.lm_head = model.embed  # as a checkpoint with tie_word_embeddings builds it
    lay_out(model)
    assert model.lm_head is model.embed
